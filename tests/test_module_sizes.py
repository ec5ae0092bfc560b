"""Every module of the packages stays under 500 lines, the size the house keeps a module to: one a reader holds in
mind. A module that grows past it is split by what its parts do (launch/benchmark_results.py and benchmark_table.py:
what was measured, and how it is shown), not cut at a line number."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 500


def test_every_module_of_the_packages_is_under_500_lines():
    sizes = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
             for package in ("pretrain", "eval", "transfer", "launch") for path in (ROOT / package).rglob("*.py")}
    assert len(sizes) > 50                                            # the packages were found
    assert {path: lines for path, lines in sizes.items() if lines >= LIMIT} == {}
