import sys

from specroll.actors.drafter_trainer.cli import main

sys.exit(main())
