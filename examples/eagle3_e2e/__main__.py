import sys

from .e2e import main

sys.exit(main())
