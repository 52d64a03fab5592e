import sys

from specroll.actors.trainer.trainer import main

sys.exit(main())
