import sys

from privtune.cli import main

sys.exit(main())
