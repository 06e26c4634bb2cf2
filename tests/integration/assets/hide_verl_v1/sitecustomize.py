"""Hides verl's v1 trainer (``verl.trainer.ppo.v1``) from every Python process started with this folder on its
``PYTHONPATH`` (``site`` imports this module at start; Ray's workers inherit the variable): importing it raises
``ModuleNotFoundError``, as on verl's ``neo`` branch, which has no v1 trainer."""

import importlib.abc
import sys


class _HideVerlV1(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "verl.trainer.ppo.v1" or name.startswith("verl.trainer.ppo.v1."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by tests/integration/assets/hide_verl_v1)",
                                      name=name)
        return None


sys.meta_path.insert(0, _HideVerlV1())
