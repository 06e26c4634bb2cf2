"""The docs site builds with ``mkdocs build --strict``, and its options reference covers every config field.

The options reference is generated at build time by ``docs/hooks/gen_options.py`` from the config dataclasses' help
metadata. The fields checked here are found independently of the generator's mapping: every dataclass that
``AsyncRMConfig`` is made of, so a new option group that the mapping misses fails this test.
"""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
GENERATOR = REPO_ROOT / "docs" / "hooks" / "gen_options.py"

pytestmark = pytest.mark.unit


def _generator():
    spec = importlib.util.spec_from_file_location("gen_options", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config_fields() -> dict[type, list[str]]:
    """The user-facing fields of every option dataclass ``AsyncRMConfig`` holds (internal fields left out)."""
    from verl_async_rm.config import AsyncRMConfig

    groups = {}
    for hint in typing.get_type_hints(AsyncRMConfig).values():
        if dataclasses.is_dataclass(hint):
            groups[hint] = [f.name for f in dataclasses.fields(hint) if not f.metadata.get("internal")]
    assert groups, "AsyncRMConfig holds no option dataclasses: has the config moved? Update this test's discovery."
    return groups


def test_every_config_field_has_a_user_key_in_the_generator():
    keys = _generator().user_keys()
    missing = [f"{cls.__name__}.{name}" for cls, names in _config_fields().items() for name in names
               if (cls.__name__, name) not in keys]
    assert missing == [], "add these classes to GROUPS in docs/hooks/gen_options.py"


def test_every_config_field_has_help_text():
    bare = [f"{cls.__name__}.{f.name}" for cls in _config_fields() for f in dataclasses.fields(cls)
            if not f.metadata.get("internal") and not f.metadata.get("help")]
    assert bare == []


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    for module in ("mkdocs", "material"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: pip install -e '.[docs]' (scripts/test.sh installs it)")
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO_ROOT / "mkdocs.yml"),
         "--site-dir", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert "WARNING" not in result.stderr, result.stderr
    return out


def test_the_site_builds_strict_with_every_page(site):
    pages = ["index.html", "guide/install/index.html", "guide/train-on-cpu/index.html", "guide/opt-in/index.html", "guide/options/index.html",
             "guide/metrics/index.html", "guide/recipes/index.html", "guide/sizing/index.html",
             "rm-kinds/index.html", "faults/index.html", "comparison/index.html", "architecture/index.html",
             "benchmarks/index.html", "layouts/index.html", "testing/index.html", "versions/index.html",
             "reference/options/index.html"]
    assert [p for p in pages if not (site / p).is_file()] == []
    assert not (site / "hooks").exists(), "the generator is not a page of the site"


def test_the_options_reference_documents_every_config_field(site):
    page = (site / "reference" / "options" / "index.html").read_text()
    keys = _generator().user_keys()
    missing = [keys[(cls.__name__, name)] for cls, names in _config_fields().items() for name in names
               if f"<code>{html.escape(keys[(cls.__name__, name)], quote=False)}</code>" not in page]
    assert missing == []


def test_the_options_reference_lists_every_per_rm_key(site):
    """Each RM and batching option may be set per extra RM (``async_rm.models.<name>.<key>``)."""
    generator = _generator()
    classes = [cls for cls in _config_fields() if cls.__name__ in generator.MODEL_CLASSES]
    assert len(classes) == len(generator.MODEL_CLASSES)
    page = (site / "reference" / "options" / "index.html").read_text()
    extra = page[page.index('id="extra-rms"'):]
    per_rm = {f.name for cls in classes for f in dataclasses.fields(cls)
              if not f.metadata.get("internal")} - set(generator.MODEL_NOT_PER_RM)
    missing = sorted(name for name in per_rm if f"<code>async_rm.models.&lt;name&gt;.{name}</code>" not in extra
                     and f"<code>{name}</code>" not in extra)
    assert missing == []


#: An option as a user writes it: ``async_rm.<key>`` or ``async_rm.models.<name>.<key>``, with or without Hydra's
#: ``+`` (not the package, ``verl_async_rm.``).
_NAMED_OPTION = re.compile(r"(?<![\w.])\+?async_rm\.((?:models\.[\w<>]+\.)?)(\w+)")


def _pages() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md")),
            *sorted((REPO_ROOT / "recipes").glob("*"))]


def test_every_option_the_docs_and_recipes_name_is_accepted_by_the_config():
    from verl_async_rm.config import CONFIG_GROUP, MODELS_KEY, option_groups

    def keys(prefix: str) -> set[str]:
        return {f.name for cls in option_groups()[prefix] for f in dataclasses.fields(cls)
                if not f.metadata.get("internal")}

    top, per_rm = keys(f"{CONFIG_GROUP}."), keys(f"{CONFIG_GROUP}.{MODELS_KEY}.<name>.") | {"weight"}
    named, unknown = 0, []
    for page in _pages():
        for match in _NAMED_OPTION.finditer(page.read_text()):
            per, key = bool(match.group(1)), match.group(2)
            if key == MODELS_KEY and not per:  # the group itself
                continue
            named += 1
            if key not in (per_rm if per else top):
                unknown.append(f"{page.relative_to(REPO_ROOT)}: {match.group(0)}")
    assert named > 50, "no options found: has the docs' spelling of keys changed? Update _NAMED_OPTION"
    assert unknown == [], "the docs name options the config does not accept"


def test_the_readme_reads_in_five_minutes_and_its_links_resolve():
    readme = (REPO_ROOT / "README.md").read_text()
    assert len(readme.split()) <= 1000  # about 4-5 minutes at 200-250 words a minute
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert local and [link for link in local if not (REPO_ROOT / link).exists()] == []
