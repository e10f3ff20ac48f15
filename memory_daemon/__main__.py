import sys

from memory_daemon.server import main

sys.exit(main())
