"""Every dotted Python name the docs show resolves (issue 51 item 7: KUBERNETES.md's `from train import
api` and SLURM.md's `train.api.setup()` were ImportErrors inside a pod or a Slurm task).

Names are read from code spans and code blocks of README.md and docs/*.md (the pages
test_readme_commands reads): `from X import Y` and `X.Y.Z` under the project's namespaces torchlaunch,
train and launch. A module is found without being imported (find_spec: launch.k8s renders a manifest
when imported), then each attribute after it is looked up. `train.X` is a config key, not a module, when X
is no module of train/ and is a key of the train section or is followed by `=` or `:`; a name ending in a
file extension is a file name (train.py).

The pages also stay a size a reader finishes (issue 56 item 3): the hand-written pages of docs/ (every
page but the generated ones, less the blocks a program writes into a page) at most 160 KB in all and
20 KB each, the README at most 10 KB, and no dated diary in any of them (figures belong in the
generated BENCHMARKS.md, history in git).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.unit.test_readme_commands import documentation_pages
from torchlaunch.trainer_sections import TrainConfig

CODE = re.compile(r"```.*?```|`[^`\n]+`|^(?: {4}|\t).*$", re.S | re.M)
NAME = re.compile(r"(?<![\w./:-])((?:torchlaunch|train|launch)(?:\.[A-Za-z_]\w*)+)(?![\w/-]|\.\w)(.?)")
FROM = re.compile(r"\bfrom\s+((?:torchlaunch|train|launch)(?:\.\w+)*)\s+import\s+\(?([\w, ]+)")
FILE_ENDINGS = frozenset({"py", "pt", "yaml", "yml", "json", "jsonl", "md", "txt", "sh", "tar", "idx", "log"})
TRAIN_KEYS = frozenset(f.name for f in dataclasses.fields(TrainConfig))


def is_config_key_or_file(name: str, after: str) -> bool:
    parts = name.split(".")
    if parts[-1] in FILE_ENDINGS:
        return True
    if parts[0] != "train" or (REPO / "train" / f"{parts[1]}.py").exists():
        return False
    return parts[1] in TRAIN_KEYS or after in ("=", ":")


def shown_names(pages: list[Path]) -> dict[str, str]:
    """{dotted name: the first page showing it}."""
    names: dict[str, str] = {}
    for page in pages:
        for code in CODE.findall(page.read_text(encoding="utf-8")):
            for m in FROM.finditer(code):
                for item in m.group(2).split(","):
                    if item.strip():
                        names.setdefault(f"{m.group(1)}.{item.split()[0]}", page.name)
            for m in NAME.finditer(code):
                if not is_config_key_or_file(m.group(1), m.group(2)):
                    names.setdefault(m.group(1), page.name)
    return names


def unresolved(name: str) -> str | None:
    """None when the longest module prefix of name exists and every attribute after it does, else why not."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            continue
        if i == len(parts):
            return None
        obj = importlib.import_module(module)
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return f"{module} has no {'.'.join(parts[i:])}"
            obj = getattr(obj, attr)
        return None
    return f"no module {parts[0]}"


def test_every_dotted_name_the_docs_show_resolves() -> None:
    names = shown_names(documentation_pages())
    assert len(names) > 40 and "launch.local" in names  # the reader still finds them
    bad = {f"{page}: {name}": why for name, page in names.items() if (why := unresolved(name))}
    assert not bad, bad


def test_the_reader_tells_names_from_config_keys_and_files(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Use `from train import api` or `train.api.setup()`; set `train.precision=auto`, see `train.py` and\n"
        "`config error: train.batchsize: unknown key`.\n\n    python -m train.shards write\n",
        encoding="utf-8",
    )
    names = shown_names([page])
    assert set(names) == {"train.api", "train.api.setup", "train.shards"}
    assert unresolved("train.api") is not None
    assert unresolved("train.shards") is None and unresolved("torchlaunch.api.setup") is None
    assert unresolved("torchlaunch.api.no_such_thing") == "torchlaunch.api has no no_such_thing"


@pytest.mark.parametrize("name", ["train.api.setup", "train.exit_codes.BadInput", "train.worker.main"])
def test_the_names_issue_51_found_do_not_resolve(name: str) -> None:
    assert unresolved(name) is not None


def test_every_test_file_the_docs_cite_exists_and_cluster_tests_are_engines() -> None:
    """Issue 51 item 10: SLURM.md and api.md cited tests/unit files for tests that run on the Slurm cluster
    (tests/engines). A cited file must be where the page says, and "on the local/dev cluster (FILE)" names a
    file of the engines floor (the unit floor runs in-process only)."""
    cited: set[tuple[str, str]] = set()
    misplaced: list[str] = []
    for page in documentation_pages():
        text = " ".join(page.read_text(encoding="utf-8").split())
        cited.update((page.name, path) for path in re.findall(r"tests/(?:unit|integration|engines)/[\w/]+\.py", text))
        misplaced += [f"{page.name}: {m.group(0)}" for m in ON_CLUSTER.finditer(text) if m.group(1) != "engines"]
    assert len(cited) > 10
    missing = sorted(f"{page}: {path}" for page, path in cited if not (REPO / path).is_file())
    assert not missing, missing
    assert not misplaced, misplaced


ON_CLUSTER = re.compile(r"on the (?:local|dev) (?:Slurm )?cluster[^()]{0,80}\(`?tests/(\w+)/\w+\.py")


def test_the_built_site_works_opened_from_disk() -> None:
    """Issue 51 item 10: with mkdocs' directory URLs a page links to `quickstart/`, which a browser shows as
    a folder listing from file://; `use_directory_urls: false` links to quickstart.html."""
    import yaml

    site = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    assert site.get("use_directory_urls") is False


GENERATED_PAGES = {"BENCHMARKS.md": "bench/run.py"}
"""docs/ pages a program writes whole: {page: the program}."""
GENERATED_BLOCK = re.compile(r"<!-- ([\w-]+):table:start -->.*?<!-- \1:table:end -->", re.S)
"""A block a program rewrites inside a hand-written page (faults/report.py: RELIABILITY.md's table)."""
DATED = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
HAND_WRITTEN_BYTES, PAGE_BYTES, README_BYTES = 160_000, 20_000, 10_000


def hand_written(page: Path) -> str:
    """The page's text less the blocks a program writes into it."""
    return GENERATED_BLOCK.sub("", page.read_text(encoding="utf-8"))


def dated_lines(name: str, text: str) -> list[str]:
    return [f"{name}:{i}: {line.strip()[:100]}" for i, line in enumerate(text.splitlines(), 1) if DATED.search(line)]


def test_the_generated_pages_and_blocks_are_written_by_a_program() -> None:
    """Only what a program writes is left out of the budget: each generated page is named by its writer,
    and the one generated block's markers are the ones faults/report.py writes."""
    for page, program in GENERATED_PAGES.items():
        assert (REPO / "docs" / page).is_file() and page in (REPO / program).read_text(encoding="utf-8")
    report = (REPO / "faults" / "report.py").read_text(encoding="utf-8")
    assert "<!-- faults:table:start -->" in report and "<!-- faults:table:end -->" in report


def test_the_hand_written_docs_stay_within_their_budget() -> None:
    pages = [p for p in sorted((REPO / "docs").glob("*.md")) if p.name not in GENERATED_PAGES]
    sizes = {p.name: len(hand_written(p).encode("utf-8")) for p in pages}
    biggest = sorted(sizes.items(), key=lambda item: -item[1])[:5]
    assert sum(sizes.values()) <= HAND_WRITTEN_BYTES, (sum(sizes.values()), biggest)
    assert not {p.name: p.stat().st_size for p in pages if p.stat().st_size > PAGE_BYTES}
    assert (REPO / "README.md").stat().st_size <= README_BYTES


def test_no_page_keeps_a_dated_diary() -> None:
    pages = [p for p in sorted((REPO / "docs").glob("*.md")) if p.name not in GENERATED_PAGES]
    found = [line for p in [REPO / "README.md", *pages] for line in dated_lines(p.name, hand_written(p))]
    assert not found, found


def test_the_budget_reader_drops_generated_blocks_and_finds_dates(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "kept\n<!-- faults:table:start -->\n| measured 2026-12-02 |\n<!-- faults:table:end -->\n"
        "Measured on 2026-12-04: 5 s.\nCommit 2026abc, 20 runs, 12-04.\n",
        encoding="utf-8",
    )
    assert "measured" not in hand_written(page) and hand_written(page).startswith("kept")
    assert dated_lines("page.md", hand_written(page)) == ["page.md:3: Measured on 2026-12-04: 5 s."]
