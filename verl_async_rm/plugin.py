"""Entry point of the ``verl.plugins`` group.

verl imports this module on ``import verl`` in every process (driver, TaskRunner, every Ray worker), so it must be
cheap and must never raise: it records that it was loaded and nothing else. The heavy parts of the package are
imported lazily by the classes that verl loads by name.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: True once verl has imported this module through its entry point (or anyone imported it directly).
LOADED = True

__all__ = ["LOADED"]
