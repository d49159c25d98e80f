"""The light test runner shipped inside every synthetic task (as the protected file ``run_tests.py``).

pytest's start-up alone costs more than the 0.3 s grading budget, so synthetic tasks run their
tests with this stdlib-only script instead: ``python -S run_tests.py [REPORT.xml]`` imports each
``test_*.py`` beside it, runs its ``test_*`` functions in file order and prints one line per
failure and a summary; with a path it also writes a JUnit (xunit1) report that
``grading.parse_junit`` reads. It must not import composer_jax: inside the sandbox only the
workspace is there. Exit code 0 = every test passed, 1 = some failed or none ran (the grader
cross-checks this against the report).

A test module that cannot be imported (a syntax error in the code under test) reports each of its
``test_*`` functions (found with ``ast``) as an error, so per-test results survive. The report path
is taken off ``sys.argv`` before any code under test is imported, the XML is written only after
every test ran (a process that exits early leaves no report, which grades 0) and each test has a
wall-clock alarm. Code under test runs in this process, so, as with pytest's conftest hooks, it can
forge this report (``tests/env/test_oracle.py`` does). That is why the grader does not read it: the
synthetic tasks are graded by values (``Task.grader = "values"``, ``env/oracle.py``), and this runner
is what the agent runs to see its failures.
"""

from __future__ import annotations

RUNNER_SOURCE = r'''"""Runs the test_*.py files here: python run_tests.py"""
import glob
import os
import re
import signal
import sys
import time

PER_TEST_S = 1  # the tests are a few arithmetic checks; a loop must not eat the grade budget


class TestTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise TestTimeout(f"test took more than {PER_TEST_S} s")


def _names(path):
    with open(path, encoding="utf-8") as f:
        return re.findall(r"^def (test_\w+)\(", f.read(), re.M)


def _esc(text):
    text = "".join(c for c in text if c >= " " or c in "\t\n")  # XML 1.0 forbids the rest
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace('"', "&quot;").replace("\n", "&#10;")


def _where(exc, path):
    """The last line of the test file in the traceback (the failing assert)."""
    import linecache
    import traceback
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if os.path.abspath(f.filename) == path]
    if not frames:
        return ""
    return f"line {frames[-1].lineno}: {linecache.getline(path, frames[-1].lineno).strip()}"


def _detail():
    import traceback
    return traceback.format_exc()


def main():
    report = sys.argv[1] if len(sys.argv) > 1 else None
    del sys.argv[1:]
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    signal.signal(signal.SIGALRM, _alarm)
    results = []  # (file, module, name, kind, message, detail, seconds)
    for path in sorted(glob.glob(os.path.join(here, "test_*.py"))):
        file = os.path.basename(path)
        module = file[:-3]
        try:
            names = _names(path)
        except (OSError, ValueError) as e:
            results.append((file, module, module, "error", f"cannot parse: {e}", "", 0.0))
            continue
        try:
            signal.setitimer(signal.ITIMER_REAL, PER_TEST_S)
            ns = vars(__import__(module))
        except BaseException as e:  # noqa: B036 - SystemExit from the code under test too
            msg = f"import failed: {type(e).__name__}: {e}"
            results += [(file, module, n, "error", msg, _detail(), 0.0) for n in names]
            continue
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for name in names:
            fn = ns.get(name)
            t0 = time.perf_counter()
            kind, msg, detail = "passed", "", ""
            try:
                signal.setitimer(signal.ITIMER_REAL, PER_TEST_S)
                fn()
            except AssertionError as e:
                kind, msg = "failed", f"AssertionError: {e}" if str(e) else "AssertionError"
                msg = f"{msg} ({_where(e, path)})"
                detail = _detail()
            except BaseException as e:  # noqa: B036
                kind, msg = "error", f"{type(e).__name__}: {e} ({_where(e, path)})"
                detail = _detail()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            results.append((file, module, name, kind, msg, detail, time.perf_counter() - t0))
    bad = [r for r in results if r[3] != "passed"]
    for file, _, name, kind, msg, _, _ in bad:
        print(f"{kind.upper()} {file}::{name} - {msg}")
    print(f"{len(results) - len(bad)} passed, {len(bad)} failed")
    if report:
        parts = ['<?xml version="1.0" encoding="utf-8"?>',
                 f'<testsuites><testsuite name="run_tests" tests="{len(results)}" '
                 f'failures="{len(bad)}">']
        for file, module, name, kind, msg, detail, sec in results:
            head = (f'<testcase classname="{_esc(module)}" name="{_esc(name)}" '
                    f'file="{_esc(file)}" time="{sec:.4f}"')
            if kind == "passed":
                parts.append(head + "/>")
            else:
                tag = "failure" if kind == "failed" else "error"
                parts.append(f'{head}><{tag} message="{_esc(msg)}">{_esc(detail)}</{tag}>'
                             "</testcase>")
        parts.append("</testsuite></testsuites>")
        with open(report, "w", encoding="utf-8") as f:
            f.write("\n".join(parts) + "\n")
    sys.stdout.flush()
    os._exit(0 if results and not bad else 1)


if __name__ == "__main__":
    main()
'''

RUNNER_PATH = "run_tests.py"
TEST_COMMAND = "python -S run_tests.py {junitxml}"
