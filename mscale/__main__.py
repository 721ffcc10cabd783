import sys

from mscale.cli import main

sys.exit(main())
