"""No test asserts a duration, a rate or a speed ratio: a busy machine makes such a test
fail. Tests assert what was computed (tokens, blocks, events); speed is measured by
``contextkit bench``.

The check follows values, not names alone: within a function, a name assigned from a
``time.*`` call (``start = time.monotonic()``), or from an expression holding such a
name, is timed; so is a name, attribute or key that says it is a duration or a rate
(``*_ms``, ``*_s``, ``seconds``, ``ttft``, ``speedup``, ``tps``, ``*_per_s``, ``gbps``,
``elapsed``, ``lag``). An ordering comparison in an ``assert`` with a timed operand is
flagged, unless every other operand is the constant 0 (a timing that exists).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TIMED_WORD = re.compile(
    r"\w*(?:ttft|speedup|elapsed|duration|seconds|latency|gbps|lag)\w*|\w+_ms|\w+_s|tps|"
    r"\w*_tps|\w*per_s\w*")
NUMBERS = re.compile(r"int|float|tuple\[(?:int|float)(?:, (?:int|float))*\]")
ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
#: Orderings that hold by construction, whatever the machine's speed: a total and its
#: part, a percentile and a lower one, a sum of CPU seconds and one call's, events
#: stamped in the order the code runs them, and an injected clock.
BY_CONSTRUCTION = {
    "gen.total_ms > gen.ttft_ms > 0",
    "result['query_p95_ms'] >= result['query_p50_ms'] > 0",
    "stats['cpu_s'] >= out.cpu_s > 0",
    "report.finished_at < turn_started",
    "report.started_at <= report.finished_at",
    "lag > 100000000000.0",
    # the bench math on synthetic turns: a ceiling bounds what it bounds
    "figures['speedup_memory_change_ceiling_total'] >= figures['speedup_memory_change_total']",
}
#: A wait that gives up: ``assert time.monotonic() < deadline`` inside a polling loop
#: ends a test that would otherwise hang; it does not measure speed.
WAIT = re.compile(r"time\.monotonic\(\) < \w*deadline")


def _is_time_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = ast.unparse(node.func)
    if func == "time.sleep":
        return False  # waits; reads no clock
    return func.startswith("time.") or func.split(".")[-1] in (
        "perf_counter", "monotonic", "perf_counter_ns", "monotonic_ns", "process_time")


def _words(node: ast.AST) -> set[str]:
    words = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            words.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            words.add(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and "." not in sub.value:
            words.add(sub.value)
    return words


def _timed_names(scope: ast.AST, known: frozenset[str] = frozenset()) -> set[str]:
    """Names assigned, within ``scope``, from time calls or from other timed names."""
    timed: set[str] = set(known)
    assigns = [n for n in ast.walk(scope) if isinstance(n, (ast.Assign, ast.AugAssign,
                                                             ast.AnnAssign))]
    changed = True
    while changed:
        changed = False
        for node in assigns:
            value = node.value
            if value is None:
                continue
            if _value_is_timed(value, timed):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for sub in ast.walk(target):
                        if isinstance(sub, ast.Name) and sub.id not in timed:
                            timed.add(sub.id)
                            changed = True
    return timed


def _value_is_timed(value: ast.AST, timed: set[str]) -> bool:
    """A value computed from a time call or a timed name by arithmetic (or min, max,
    sum, round, abs): not a container or an object built around one."""
    if isinstance(value, ast.Call):
        func = ast.unparse(value.func)
        return (_is_time_call(value) or func in timed
                or any(isinstance(a, ast.Call) and _value_is_timed(a, timed)
                       for a in value.args)
                or (func in ("min", "max", "sum", "round", "abs", "float", "int")
                    and any(_value_is_timed(a, timed) for a in value.args)))
    if isinstance(value, ast.Name):
        return value.id in timed
    if isinstance(value, ast.BinOp):
        return _value_is_timed(value.left, timed) or _value_is_timed(value.right, timed)
    if isinstance(value, ast.UnaryOp):
        return _value_is_timed(value.operand, timed)
    if isinstance(value, (ast.Subscript, ast.Attribute)):
        return _value_is_timed(value.value, timed)
    if isinstance(value, ast.IfExp):
        return _value_is_timed(value.body, timed) or _value_is_timed(value.orelse, timed)
    return False


def _is_timed(node: ast.AST, timed: set[str]) -> bool:
    return (any(_value_is_timed(s, timed) for s in ast.walk(node))
            or any(TIMED_WORD.fullmatch(w) for w in _words(node)))


def timed_asserts(source: str) -> list[str]:
    """The ordering comparisons in ``assert`` statements that involve a timing."""
    tree = ast.parse(source)
    found = []
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                          ast.AsyncFunctionDef))]
    # a helper of the module that reads the clock and returns numbers returns timings:
    # its callers' names are timed (``ticks, idle = asyncio.run(_ticks_during(work))``)
    clocks = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef,
                                                          ast.AsyncFunctionDef))
              and n.returns is not None and NUMBERS.fullmatch(ast.unparse(n.returns))
              and any(_is_time_call(s) for s in ast.walk(n))}
    module_timed = clocks | _timed_names(ast.Module(body=[
        n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.ClassDef))], type_ignores=[]))
    for scope in [tree, *scopes]:
        timed = _timed_names(scope, frozenset(module_timed))
        body = scope.body if isinstance(scope, ast.Module) else [scope]
        for node in (n for b in body for n in ast.walk(b)):
            if not isinstance(node, ast.Assert):
                continue
            for compare in ast.walk(node.test):
                if not isinstance(compare, ast.Compare) or not any(
                        isinstance(op, ORDERING) for op in compare.ops):
                    continue
                operands = [compare.left, *compare.comparators]
                zero = [o for o in operands if isinstance(o, ast.Constant) and o.value == 0]
                if any(_is_timed(o, timed) for o in operands) and len(operands) - len(zero) > 1:
                    found.append(ast.unparse(compare))
    return sorted(set(found))


def test_the_finder_flags_what_a_comparison_involves() -> None:
    # the five that passed the earlier name-only check
    assert timed_asserts("def t():\n    start = time.monotonic()\n    work()\n"
                         "    assert time.monotonic() - start < 60\n")
    assert timed_asserts("def t():\n    stats = run()\n    assert stats['seconds'] < 120\n")
    assert timed_asserts("def t():\n    t0 = time.perf_counter()\n    idle = t0 * 2\n"
                         "    ticks = count()\n    assert ticks >= 0.8 * idle\n")
    assert timed_asserts("def span() -> tuple[int, int]:\n    t0 = time.perf_counter()\n"
                         "    return t0, t0\n"
                         "def t():\n    ticks, idle = asyncio.run(span())\n"
                         "    assert ticks >= 0.8 * idle\n")
    assert timed_asserts("def t():\n    tps = gen.decode_tps\n    assert 0.1 < tps < 10_000\n")
    assert timed_asserts("def t():\n    assert all(u['lag_s'] < 60 for u in ups)\n")
    # and the ones the names gave away
    assert timed_asserts("def t():\n    assert r['ttft_ms'] < base['ttft_ms'] / 5\n")
    assert timed_asserts("def t():\n    assert result['speedup_p50'] > 1.5\n")


def test_the_finder_leaves_counts_alone() -> None:
    assert not timed_asserts(
        "def t():\n    assert r['ttft_ms'] > 0 and r['prompt_tokens'] > 1000\n")
    assert not timed_asserts("def t():\n    assert reused > computed\n")
    assert not timed_asserts("def t():\n    start = time.monotonic()\n    n = len(xs)\n"
                             "    assert n >= 3\n")
    assert not timed_asserts("def t():\n    assert report['hit_rate'] >= 0.9\n")
    assert not timed_asserts("def t():\n    stats = {'seconds': time.time() - t0, 'n': n}\n"
                             "    assert stats['n'] >= 3\n")


def test_no_test_asserts_a_duration_or_a_speed_ratio() -> None:
    timed = {f"{path.relative_to(ROOT)}: {expr}"
             for path in (ROOT / "tests").rglob("*.py")
             for expr in timed_asserts(path.read_text())
             if expr not in BY_CONSTRUCTION and not WAIT.fullmatch(expr)}
    assert not timed, sorted(timed)
