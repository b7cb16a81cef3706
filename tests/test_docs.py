"""What the documentation shows stays what the code does: the plugin page's example code is
the example files (the page is read on GitHub too, where an include shows nothing), and the
sweeps page describes every key a suite file may hold, with an example that expands."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from che_bench.run import suites

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPOSITORY = Path(__file__).resolve().parents[1]
DOCS = REPOSITORY / "docs"
EXAMPLE_BLOCK = re.compile(r"<!-- example: (\S+) [^>]*-->\n```python\n(.*?)```\n", re.S)


def test_the_plugin_page_shows_the_example_files_as_they_are():
    page = (DOCS / "plugins.md").read_text()
    blocks = dict(EXAMPLE_BLOCK.findall(page))
    assert set(blocks) == {
        "examples/my_plugin.py",
        "examples/content_plugin.py",
        "examples/che-bench-loglength/che_bench_loglength/model.py",
    }
    for path, shown in blocks.items():
        assert shown == (REPOSITORY / path).read_text(), (
            f"docs/plugins.md shows another {path}: copy the file into the page")
    assert "--8<--" not in page  # an include shows nothing where the page is read raw


def _suite_section() -> str:
    page = (DOCS / "sweeps.md").read_text()
    return page.split("### Suite files\n", 1)[1].split("\n## ", 1)[0]


def test_the_sweeps_page_names_every_key_a_suite_file_takes():
    section = _suite_section()
    keys = (
        set(suites._TOP_LEVEL_KEYS)
        | set(suites._RESOURCE_KEYS)
        | {key for keys in suites._ENTRY_KEYS.values() for key in keys}
        | set(suites._GRID_SETTINGS)
    )
    for key in sorted(keys):
        # As code (`seeds`, `[overrides]`) or assigned (options = { ... }).
        assert re.search(rf"`{key}`|`\[{key}\]`|\b{key} =", section), key


def test_the_sweeps_page_example_expands():
    section = _suite_section()
    [example] = re.findall(r"```toml\n(.*?)```", section, re.S)
    data = tomllib.loads(example)
    assert set(data) == suites._TOP_LEVEL_KEYS  # the example holds every key
    suite = suites.parse_suite(data, Path("example.toml"))
    configs = suite.configs()
    # 3 seeds x 2 rates x 2 tasks x (none, alibi: 2 kernels; kerple: 3; lstm; tape_rnn)
    assert len(configs) == 3 * 2 * 2 * (2 + 2 + 3 + 1 + 1)
    assert {config.steps for config in configs} == {500}
