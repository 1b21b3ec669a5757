import sys

from promptlint.cli import main

sys.exit(main())
