import sys

from specroll.actors.server.cli import main

sys.exit(main())
