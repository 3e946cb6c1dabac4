"""The verifier's symbolic path (common/verifier.py): whether two normalised answers that are neither plain
numbers nor equal as text are the same answer, and a key under which equal answers agree.

    same("(x+1)^2", "x^2+2x+1")                            -> True
    same("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}")    -> True
    key("3, 1") == key("\\{1, 3\\}")                        -> True (majority voting)

1. Tokens: numbers, LaTeX commands (\\frac, \\sqrt, \\pi, \\sin, \\cdot, \\pm, \\le, ...), letters, one-character
   operators; `\\cotx` splits into \\cot and x.
2. Parse, by recursive descent, into a tree of nested tuples: expressions (sums, products, powers, roots,
   functions, factorials, binomials, absolute values, floor and ceiling, ±) and structures (tuples and
   intervals, unordered lists and sets, unions, matrices, relations, base-b numbers).
3. Evaluate: exactly with fractions where the values are rational (the root of a perfect power stays exact),
   in complex floating point otherwise, at POINTS fixed points for the variables.
4. Compare: structures member by member (lists and sets in any order, ± as its two values, an equation
   against any multiple of itself), values point by point (exact fractions equal; floating point within
   SYM_TOL, or REL_TOL when a written decimal is involved). Equal at every point is equal.

Bounded in time: only strings up to MAX_SYMBOLIC characters are parsed, nesting stops at MAX_DEPTH, an exact
number beyond MAX_BITS bits falls back to floating point, lists stop at MAX_ITEMS; no eval, no sympy.
Anything that fails to parse or evaluate is not the same answer.
"""

import cmath
import functools
import math
import re
import zlib
from fractions import Fraction

REL_TOL = 1e-6  # tolerance when a written decimal is involved (0.333333 vs 1/3)
SYM_TOL = 1e-9  # tolerance between two floating-point evaluations of exact forms (sqrt, pi, sin)
MAX_SYMBOLIC = 300  # longest normalised answer the symbolic path parses; MATH answers are < 100
MAX_DEPTH = 40  # parser nesting limit: recursion stays far below Python's
MAX_BITS = 4096  # an exact fraction larger than this falls back to floating point
MAX_ITEMS = 32  # longest list, set or matrix compared (element matching is quadratic)
POINTS = 3  # points at which expressions with variables are compared

_HAS_DECIMAL = re.compile(r"\d\.\d|(?<!\d)\.\d")

# ------------------------------------------------------------------ parse

_TOK = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(?:[eE]([-+]?\d{1,3})(?![\w.]))?"  # 12, 0.5, 1.5e-3
                  r"|\\begin\{(\w+)\}(?:(?<=\{array\})\{[lcr|]*\})?|\\end\{\w+\}"  # matrices; array's {cc} skipped
                  r"|\\\\|\\[{}|]|\\([a-zA-Z]+)|([a-zA-Z])|(\S)")
_FUNCS = {"sin": cmath.sin, "cos": cmath.cos, "tan": cmath.tan, "cot": lambda z: 1 / cmath.tan(z),
          "sec": lambda z: 1 / cmath.cos(z), "csc": lambda z: 1 / cmath.sin(z), "arcsin": cmath.asin,
          "arccos": cmath.acos, "arctan": cmath.atan, "sinh": cmath.sinh, "cosh": cmath.cosh,
          "tanh": cmath.tanh, "exp": cmath.exp, "ln": cmath.log, "log": cmath.log}  # \log: natural, as sympy
_GREEK = set("alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi "
             "rho sigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Phi Psi "
             "Omega".split())
_CONSTS = {"pi": ("c", "pi"), "infty": ("c", "inf")}
_OPS = {"cdot": "*", "times": "*", "ast": "*", "div": "/", "pm": "pm", "mp": "mp", "cup": "cup",
        "le": "<=", "leq": "<=", "ge": ">=", "geq": ">=", "lt": "<", "gt": ">", "ne": "!=", "neq": "!=",
        "frac": "frac", "sqrt": "sqrt", "binom": "binom", "dbinom": "binom", "tbinom": "binom",
        "lfloor": "lfloor", "rfloor": "rfloor", "lceil": "lceil", "rceil": "rceil"}
_KNOWN = set(_FUNCS) | _GREEK | set(_CONSTS) | set(_OPS)
_RELATIONS = {"=", "<", ">", "<=", ">=", "!="}
_MATRICES = {"pmatrix", "bmatrix", "Bmatrix", "matrix", "smallmatrix", "array"}
_VALUES = {"pi": complex(math.pi), "e": complex(math.e), "i": 1j, "inf": math.inf}


def _tokens(s: str) -> list[tuple[str, object, str]]:
    """(kind, value, text) triples; `\\cotx` (from `\\cot x` without its space) splits into \\cot, x."""
    out = []
    for m in _TOK.finditer(s):
        number, exp10, begin, cmd, letter, char = m.groups()
        if number is not None:
            value = Fraction(number) * (Fraction(10) ** int(exp10) if exp10 else 1)
            out.append(("num", value, m[0]))
        elif begin is not None:
            out.append(("begin", begin, m[0]))
        elif m[0].startswith("\\end"):
            out.append(("end", None, m[0]))
        elif cmd is not None:
            head = cmd if cmd in _KNOWN else next((cmd[:k] for k in range(len(cmd) - 1, 0, -1)
                                                    if cmd[:k] in _KNOWN), cmd)
            out.append(("op", _OPS[head], m[0]) if head in _OPS else ("cmd", head, "\\" + head))
            out.extend(("let", c, c) for c in cmd[len(head) :])
        elif letter is not None:
            out.append(("let", letter, letter))
        else:
            out.append(("op", char or m[0], m[0]))  # one character, or `\\`, `\{`, `\}`, `\|`
    return out


class _Parser:
    """Recursive descent over _tokens; a tree is nested tuples, e.g. ("+", ("n", 1), ("v", "x")).

    Numbers: n (Fraction) v (variable) c (pi, e, i, inf) + - * / ^ neg ! root f (function) abs floor
    ceil binom, and pm / mp / pmu for ±. Structures: tuple (brackets and items), set (unordered:
    \\{...\\} or a bare comma list), union, mat (rows of cells), rel (=, <, <=, !=), base (52_8).
    """

    def __init__(self, tokens):
        self.t, self.i, self.depth = tokens, 0, 0

    def at(self, *values) -> bool:
        return self.i < len(self.t) and self.t[self.i][0] == "op" and self.t[self.i][1] in values

    def kind(self) -> str | None:
        return self.t[self.i][0] if self.i < len(self.t) else None

    def take(self):
        if self.i >= len(self.t):
            raise ValueError("unexpected end")
        self.i += 1
        return self.t[self.i - 1]

    def expect(self, value):
        if not self.at(value):
            raise ValueError(f"expected {value}")
        self.i += 1

    def deeper(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ValueError("nested too deep")

    def parse(self):
        items = self.items()
        if self.i != len(self.t):
            raise ValueError("trailing tokens")
        return items[0] if len(items) == 1 else ("set", items)

    def items(self) -> list:
        out = [self.item()]
        while self.at(","):
            self.take()
            out.append(self.item())
            if len(out) > MAX_ITEMS:
                raise ValueError("too many items")
        return out

    def item(self):
        left = self.union()
        if self.i < len(self.t) and self.t[self.i][0] == "op" and self.t[self.i][1] in _RELATIONS:
            op = self.take()[1]
            right = self.union()
            if op in (">", ">="):  # a > b is b < a
                op, left, right = op.replace(">", "<"), right, left
            return ("rel", op, left, right)
        return left

    def union(self):
        parts = [self.expr()]
        while self.at("cup"):
            self.take()
            parts.append(self.expr())
        return parts[0] if len(parts) == 1 else ("union", parts)

    def expr(self):
        self.deeper()
        if self.at("+"):
            self.take()
        if self.at("-"):
            self.take()
            node = ("neg", self.term())
        elif self.at("pm", "mp"):
            self.take()
            node = ("pmu", self.term())
        else:
            node = self.term()
        while self.at("+", "-", "pm", "mp"):
            op = self.take()[1]
            node = (op, node, self.term())
        self.depth -= 1
        return node

    def starts_atom(self) -> bool:  # implicit multiplication: 2x, 3\sqrt{13}, (a+5)(b+2)
        k = self.kind()
        return k in ("num", "let", "cmd") or self.at("(", "frac", "sqrt", "binom", "lfloor", "lceil")

    def term(self):
        node = self.factor()
        while True:
            if self.at("*", "/"):
                op = self.take()[1]
                node = (op, node, self.factor())
            elif self.starts_atom():
                node = ("*", node, self.factor())
            else:
                return node

    def factor(self):
        self.deeper()
        if self.at("-"):
            self.take()
            node = ("neg", self.factor())
        else:
            if self.at("+"):
                self.take()
            node = self.power()
        self.depth -= 1
        return node

    def power(self):
        node = self.atom()
        while self.at("!"):
            self.take()
            node = ("!", node)
        if self.at("^"):
            self.take()
            node = ("^", node, self.script())
        return node

    def script(self):  # the argument of ^: {group}, or one signed atom
        self.deeper()
        if self.at("-"):
            self.take()
            node = ("neg", self.script())
        else:
            node = self.group() if self.at("{") else self.atom()
        self.depth -= 1
        return node

    def group(self):  # {expr}
        self.expect("{")
        node = self.item()
        self.expect("}")
        return node

    def arg(self):  # the argument of \frac, \sqrt, \binom: {group} or one token
        return self.group() if self.at("{") else self.atom()

    def subscript(self) -> str:  # the text of _x or _{...}, as written
        if not self.at("{"):
            return self.take()[2]
        self.take()
        text, depth = [], 1
        while True:
            tok = self.take()
            depth += tok[0] == "op" and tok[1] == "{"
            depth -= tok[0] == "op" and tok[1] == "}"
            if depth == 0:
                return "".join(text)
            text.append(tok[2])

    def atom(self):
        kind, value, text = self.take()
        if kind == "num":
            if self.at("_"):  # a number in another base: compared as written, never by value
                self.take()
                return ("base", text + "_" + self.subscript())
            if value.denominator == 1 and self.at("frac"):  # mixed number 1\frac{4}{5} = 1 + 4/5
                start = self.i
                frac = self.atom()
                if frac[1][0] == "n" and frac[2][0] == "n":
                    return ("+", ("n", value), frac)
                self.i = start
            return ("n", value)
        if kind == "let":
            name = value + ("_" + self.subscript() if self.at("_") else "")
            return ("c", name) if name in ("e", "i") else ("v", name)
        if kind == "cmd":
            return self.command(value)
        if kind == "begin":
            return self.matrix(value)
        if kind == "op" and value == "frac":
            return ("/", self.arg(), self.arg())
        if kind == "op" and value == "sqrt":
            index = None
            if self.at("["):
                self.take()
                index = self.expr()
                self.expect("]")
            return ("root", index, self.arg())
        if kind == "op" and value == "binom":
            return ("binom", self.arg(), self.arg())
        if kind == "op" and value in ("lfloor", "lceil"):
            inner = self.expr()
            self.expect("rfloor" if value == "lfloor" else "rceil")
            return ("floor" if value == "lfloor" else "ceil", inner)
        if kind == "op" and value in ("(", "["):
            items = self.items()
            close = self.take()[1]
            if close not in (")", "]"):
                raise ValueError("unclosed bracket")
            if len(items) == 1 and value + close in ("()", "[]"):
                return items[0]
            return ("tuple", value, close, items)
        if value == "\\{":
            items = self.items()
            self.expect("\\}")
            return ("set", items)
        if value == "{":
            self.i -= 1
            return self.group()
        if value == "|":
            inner = self.expr()
            self.expect("|")
            return ("abs", inner)
        raise ValueError(f"unexpected {text}")

    def command(self, name: str):
        if name in _CONSTS:
            return _CONSTS[name]
        if name in _GREEK:
            return ("v", name + ("_" + self.subscript() if self.at("_") else ""))
        if name in _FUNCS:
            power = base = None
            if self.at("^"):  # \sin^2 x
                self.take()
                power = self.script()
            if name == "log" and self.at("_"):  # \log_2 8
                self.take()
                base = self.script()
            node = ("f", name, self.power(), base)
            return ("^", node, power) if power is not None else node
        raise ValueError(f"unknown command \\{name}")

    def matrix(self, env: str):
        if env not in _MATRICES:
            raise ValueError(f"unknown environment {env}")
        rows = [[]]
        while self.kind() != "end":
            rows[-1].append(self.item())
            if self.at("&"):
                self.take()
            elif self.at("\\\\"):
                self.take()
                if self.kind() != "end":  # a trailing `\\` before \end adds no row
                    rows.append([])
            elif self.kind() != "end":
                raise ValueError("expected & or \\\\")
            if sum(len(r) for r in rows) > MAX_ITEMS:
                raise ValueError("matrix too large")
        self.take()
        if len({len(r) for r in rows}) != 1:
            raise ValueError("ragged matrix")
        return ("mat", rows)

# ------------------------------------------------------------------ evaluate

def _checked(v):
    """An exact fraction stays exact while it is small; a huge one becomes a float (or overflows)."""
    if isinstance(v, Fraction) and max(v.numerator.bit_length(), v.denominator.bit_length()) > MAX_BITS:
        return complex(v)
    return v


def _int_root(x: int, n: int) -> int | None:
    """The exact n-th root of a non-negative integer, or None."""
    if x.bit_length() > 1000:
        return None
    r = round(x ** (1.0 / n))
    return next((c for c in (r - 1, r, r + 1) if c >= 0 and c**n == x), None)


def _exact_root(a: Fraction, n: int) -> Fraction | None:
    if a < 0:
        r = _exact_root(-a, n) if n % 2 else None
        return -r if r is not None else None
    p, q = _int_root(a.numerator, n), _int_root(a.denominator, n)
    return Fraction(p, q) if p is not None and q is not None else None


def _pow(a, b):
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        if b.denominator == 1:
            size = max(a.numerator.bit_length(), a.denominator.bit_length(), 1)
            if abs(b.numerator) * size <= MAX_BITS:
                return a**b.numerator
        elif b.denominator <= 12 and (r := _exact_root(a, b.denominator)) is not None:
            return _pow(r, Fraction(b.numerator))
    return complex(a) ** complex(b)


def _root(a, n):
    if not (isinstance(n, Fraction) and n.denominator == 1 and 2 <= n <= 64):
        raise ValueError("root index")
    n = int(n)
    if isinstance(a, Fraction):
        r = _exact_root(a, n)
        if r is not None:
            return r
        if a < 0 and n % 2:  # the real odd root: \sqrt[3]{-2} = -\sqrt[3]{2}
            return -complex(float(-a) ** (1.0 / n))
    return cmath.sqrt(a) if n == 2 else cmath.exp(cmath.log(a) / n)


def _integer(v, limit: int) -> int:
    if not (isinstance(v, Fraction) and v.denominator == 1 and 0 <= v <= limit):
        raise ValueError("expected a small non-negative integer")
    return int(v)


def _real(v) -> Fraction | float:
    if isinstance(v, Fraction):
        return v
    v = complex(v)
    if abs(v.imag) > SYM_TOL * max(1.0, abs(v.real)):
        raise ValueError("not real")
    return v.real


def _ev(node, env: dict):
    """The value of an expression tree: a Fraction when exact, else a complex (or +-inf)."""
    op = node[0]
    if op == "n":
        return node[1]
    if op == "v":
        return env[node[1]]
    if op == "c":
        return _VALUES[node[1]]
    if op == "neg":
        return -_ev(node[1], env)
    if op in ("+", "-", "*", "/"):
        a, b = _ev(node[1], env), _ev(node[2], env)
        v = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b
        return _checked(v)
    if op == "^":
        return _checked(_pow(_ev(node[1], env), _ev(node[2], env)))
    if op == "root":
        return _root(_ev(node[2], env), Fraction(2) if node[1] is None else _ev(node[1], env))
    if op == "f":
        x = complex(_ev(node[2], env))
        v = _FUNCS[node[1]](x)
        return v / cmath.log(complex(_ev(node[3], env))) if node[3] is not None else v
    if op == "!":
        return Fraction(math.factorial(_integer(_ev(node[1], env), 1000)))
    if op == "binom":
        n = _integer(_ev(node[1], env), 1000)
        return Fraction(math.comb(n, _integer(_ev(node[2], env), n)))
    if op == "abs":
        v = _ev(node[1], env)
        return abs(v) if isinstance(v, Fraction) else complex(abs(v))
    if op in ("floor", "ceil"):
        v = _real(_ev(node[1], env))
        return Fraction(math.floor(v) if op == "floor" else math.ceil(v))
    raise ValueError(f"{op} is not a number")  # a tuple, set, matrix, base-b number, ±

# ------------------------------------------------------------------ compare

def _close(a, b, loose: bool) -> bool:
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        if a == b:
            return True  # integers must match exactly: 27648 is not 27649
        return loose and not (a.denominator == 1 and b.denominator == 1) and math.isclose(
            float(a), float(b), rel_tol=REL_TOL)
    a, b = complex(a), complex(b)
    if not (cmath.isfinite(a) and cmath.isfinite(b)):
        return a == b  # \infty only equals \infty
    diff = abs(a - b)
    return diff <= (REL_TOL if loose else SYM_TOL) * max(abs(a), abs(b)) or diff <= 1e-12


def _names(node, out: set) -> set:
    """The variable names in a tree."""
    if isinstance(node, tuple):
        if node[0] == "v":
            out.add(node[1])
        for child in node[1:]:
            _names(child, out)
    elif isinstance(node, list):
        for child in node:
            _names(child, out)
    return out


def _point(names: set, k: int) -> dict:
    """Variable values of point k: rationals in [0.5, 2.5] picked by a hash of the name (x and y
    differ), the last point negative (so |x| is not x)."""
    env = {}
    for name in names:
        v = Fraction(500 + zlib.crc32(f"{name}/{k}".encode()) % 2000, 997)
        env[name] = -v if k == POINTS - 1 else v
    return env


def _alternatives(node) -> list:
    """The values a ± stands for: 1 \\pm \\sqrt{2} -> [1 + \\sqrt{2}, 1 - \\sqrt{2}]; [node] without one."""
    op = node[0]
    if op in ("pm", "mp"):
        return [(s, a, b) for a in _alternatives(node[1]) for b in _alternatives(node[2]) for s in "+-"]
    if op == "pmu":
        return [v for a in _alternatives(node[1]) for v in (a, ("neg", a))]
    if op in ("+", "-", "*", "/", "^"):
        return [(op, a, b) for a in _alternatives(node[1]) for b in _alternatives(node[2])]
    if op == "neg":
        return [("neg", a) for a in _alternatives(node[1])]
    return [node]


def _elements(node) -> list | None:
    """The members of an unordered answer (a set, a bare list, a union, a ±), else None."""
    items = node[1] if node[0] in ("set", "union") else [node]
    if node[0] == "set" and all(x[0] == "rel" and x[1] == "=" and x[2][0] == "v" for x in items) \
            and len({x[2] for x in items}) == 1:
        items = [x[3] for x in items]  # x = -2, x = 1: the values of one variable
    out = [v for item in items for v in _alternatives(item)]
    if len(out) > MAX_ITEMS:
        raise ValueError("too many elements")
    return out if node[0] in ("set", "union") or len(out) > 1 else None


class _Compare:
    """Equality of two parsed answers, evaluated at the same points."""

    def __init__(self, envs: list[dict], loose: bool):
        self.envs, self.loose = envs, loose
        self.memo = {}  # (id(node), point) -> value: each member of a list is evaluated once

    def same(self, a, b) -> bool:
        ea, eb = _elements(a), _elements(b)
        if ea is not None or eb is not None:  # unordered: match members one to one
            if ea is None or eb is None or len(ea) != len(eb) or (a[0] == "union") != (b[0] == "union"):
                return False
            rest = list(eb)
            for x in ea:
                j = next((j for j, y in enumerate(rest) if self.same(x, y)), None)
                if j is None:
                    return False
                del rest[j]
            return True
        ka, kb = a[0], b[0]
        if ka == "tuple" or kb == "tuple":  # ordered pair, point, interval: brackets must agree
            return (ka == kb and a[1:3] == b[1:3] and len(a[3]) == len(b[3])
                    and all(self.same(x, y) for x, y in zip(a[3], b[3])))
        if ka == "mat" or kb == "mat":
            return (ka == kb and [len(r) for r in a[1]] == [len(r) for r in b[1]]
                    and all(self.same(x, y) for ra, rb in zip(a[1], b[1]) for x, y in zip(ra, rb)))
        if ka == "rel" or kb == "rel":
            return ka == kb and self.same_relation(a, b)
        return self.same_value(a, b)

    def value(self, node, k: int):
        """The value of `node` at point k, None where it has none (a pole, an overflow, a tuple)."""
        key = (id(node), k)
        if key not in self.memo:
            try:
                v = _ev(node, self.envs[k])
            except Exception:
                v = None
            self.memo[key] = (node, v)  # the node is kept alive, so its id is not reused
        return self.memo[key][1]

    def same_value(self, a, b) -> bool:
        seen = False
        for k in range(len(self.envs)):  # point by point: most wrong answers differ at the first
            x, y = self.value(a, k), self.value(b, k)
            if x is None and y is None:
                continue
            if x is None or y is None or not _close(x, y, self.loose):
                return False
            seen = True
        return seen

    def same_relation(self, a, b) -> bool:
        if a[1] != b[1]:
            return False
        if a[1] == "=" and len(self.envs) > 1:  # one equation a multiple of the other: lhs - rhs
            ratio = None
            fa, fb = ("-", a[2], a[3]), ("-", b[2], b[3])
            for x, y in ((self.value(fa, k), self.value(fb, k)) for k in range(len(self.envs))):
                if x is None or y is None:
                    return False
                if _close(y, Fraction(0), False):
                    if not _close(x, Fraction(0), False):
                        return False
                    continue
                r = x / y
                if ratio is None:
                    if _close(r, Fraction(0), False):
                        return False
                    ratio = r
                elif not _close(r, ratio, self.loose):
                    return False
            return ratio is not None
        if self.same(a[2], b[2]) and self.same(a[3], b[3]):
            return True
        return a[1] in ("=", "!=") and self.same(a[2], b[3]) and self.same(a[3], b[2])


@functools.lru_cache(maxsize=1024)  # a reference answer is parsed once, not once per completion
def _parse(s: str):
    """The tree of a normalised answer, or None when it is not one we can read."""
    if len(s) > MAX_SYMBOLIC:
        return None
    try:
        return _Parser(_tokens(s)).parse()
    except Exception:
        return None

def same(a: str, b: str) -> bool:
    """Whether two normalised answers are the same: equal structures whose values agree at every point."""
    ta, tb = _parse(a), _parse(b)
    if ta is None or tb is None:
        return False
    names = _names(ta, set()) | _names(tb, set())
    envs = [_point(names, k) for k in range(POINTS)] if names else [{}]
    loose = bool(_HAS_DECIMAL.search(a) or _HAS_DECIMAL.search(b))
    return _Compare(envs, loose).same(ta, tb)


def _key(node, env: dict) -> str:
    """A text form of a parsed answer under which equal answers agree (sets sorted, values rounded)."""
    if node[0] in ("set", "union") or len(_alternatives(node)) > 1:
        return node[0][0] + "{" + ",".join(sorted(_key(x, env) for x in _elements(node))) + "}"
    if node[0] == "tuple":
        return node[1] + ",".join(_key(x, env) for x in node[3]) + node[2]
    if node[0] == "mat":
        return "[" + ";".join(",".join(_key(x, env) for x in row) for row in node[1]) + "]"
    if node[0] in ("rel", "base"):
        raise ValueError("keyed by text")
    v = _ev(node, env)
    if isinstance(v, Fraction):
        return str(v)
    v = complex(v)
    return f"{v.real:.9g}" + (f"{v.imag:+.9g}i" if abs(v.imag) > SYM_TOL * max(1.0, abs(v.real)) else "")


def key(s: str) -> str | None:
    """A text form of a normalised answer under which equal answers agree (variables named, sets sorted, values
    rounded), or None where there is none: an answer we cannot read, an equation, a base-b number, a pole."""
    tree = _parse(s)
    if tree is None:
        return None
    try:
        names = _names(tree, set())
        return ",".join(sorted(names)) + ":" + _key(tree, _point(names, 0))
    except Exception:  # an equation, a base-b number, a pole: keyed by its text
        return None
