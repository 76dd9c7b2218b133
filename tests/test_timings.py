"""tests/timings.py: the table `make test` ends with, read from the JUnit XML its tiers write."""
import timings

FAST = """<testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.test_a" name="test_quick" time="0.5"/>
<testcase classname="tests.test_a" name="test_failed" time="2.0"><failure message="x"/></testcase>
<testcase classname="tests.test_b" name="test_skipped" time="0.0"><skipped message="no chromium"/></testcase>
</testsuite></testsuites>"""
SLOW = """<testsuites><testsuite name="pytest" tests="2" time="30.5">
<testcase classname="tests.test_c" name="test_launch" time="40.0"/>
<testcase classname="tests.test_c" name="test_other" time="12.25"/>
</testsuite></testsuites>"""
NBVAL = """<testsuites><testsuite name="pytest" tests="3">
<testcase classname="notebooks.01_ddp_fundamentals.ipynb" name="Cell 0" time="1.5"/>
<testcase classname="notebooks.01_ddp_fundamentals.ipynb" name="Cell 3" time="20.0"/>
<testcase classname="notebooks.10_pipeline_parallel.ipynb" name="Cell 2" time="99.0"/>
</testsuite></testsuites>"""


def test_the_table_counts_each_tier_and_adds_up_each_notebooks_cells(tmp_path):
    for tier, text in (("fast", FAST), ("slow", SLOW), ("nbval", NBVAL)):
        (tmp_path / f"{tier}.xml").write_text(text)
    table = timings.table(tmp_path)
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[:7] if line and line[0].isalpha()}
    assert rows["fast"] == ["3", "1", "1", "2", "2"]  # no suite time in the file: the tests' sum
    assert rows["slow"] == ["2", "0", "0", "52", "30"]  # two xdist workers: the wall clock, less than the sum
    assert rows["nbval"] == ["3", "0", "0", "120", "120"] and rows["all"] == ["8", "175", "154"]
    slowest = table.split("ten slowest tests")[1].split("notebooks under nbval")[0]
    assert slowest.index("test_launch") < slowest.index("test_other") < slowest.index("test_failed")
    assert "Cell" not in slowest  # notebook cells are counted per notebook, not as tests
    assert "21.5 s  01_ddp_fundamentals.ipynb" in table and "99.0 s  10_pipeline_parallel.ipynb" in table


def test_without_junit_files_the_table_says_what_to_run(tmp_path):
    assert "make test" in timings.table(tmp_path)
