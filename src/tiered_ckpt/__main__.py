import sys

from tiered_ckpt.cli.app import main

sys.exit(main())
