import sys

from tiered_demo.cli import main

sys.exit(main())
