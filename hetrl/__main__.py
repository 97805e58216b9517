import sys

from hetrl.cli import main

sys.exit(main())
