import sys

from verl_async_rm.cli import main

sys.exit(main())
