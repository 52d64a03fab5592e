import sys

from specroll.actors.trainer.cli import main

sys.exit(main())
