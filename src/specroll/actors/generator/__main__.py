import sys

from specroll.actors.generator.cli import main

sys.exit(main())
