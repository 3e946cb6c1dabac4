"""Answer checking: the reward every algorithm in this repo trains on.

    score(completion, answer) -> 1.0 if the completion's final answer equals `answer`, else 0.0

    python bench/verifier.py        # accuracy, false accepts and time per call, beside math-verify's

1. Extract the final answer from the completion: the last non-empty \\boxed{...} (or \\fbox{...},
   `\\boxed 5`), else the text after the last `####`, else what follows the last explicit cue
   (`The answer is 7`, `Final answer: $x+1$`), else the last number that stands on its own. A digit
   inside a word (`n00b`), a subscript or exponent (`\\mathbb{F}_{2}`, `x^2`), a list or citation
   marker (`#1.`, `[1]`, `2. Next ...`) is not an answer: paying for it would invite reward hacking.
2. Normalise both sides as text: LaTeX spacing, $ signs, \\text{}-style wrappers, \\left/\\right,
   units, degrees, percent, thousands separators, \\frac/\\sqrt shorthands, `x =` prefixes, ...
3. Compare, rules first (the fast path, ~0.2 ms a call): equal strings, or equal plain numbers
   (integers, decimals, a/b, \\frac{a}{b}, mixed numbers, 2.6\\times10^4; exact, with a 1e-6
   relative tolerance when a decimal is involved). A plain number only equals a plain number:
   `3 + 4` or `\\sqrt{49}` against 7 would pay a policy for echoing the question's arithmetic.
   When neither side is a plain number and the text rules say no, a small symbolic path decides
   (~1 ms): both sides are parsed into expression trees (sums, products, powers, roots, \\pi, i,
   functions, ±) and structures (tuples, intervals, unions, unordered lists and sets, matrices,
   equations) and evaluated, exactly with fractions where the values are rational and in complex
   floating point otherwise, at a few fixed points for the variables. Equal at every point is
   equal: sums in another order, factored forms, other spellings of a surd or of \\pi, complex
   numbers, solution lists in another order, `1 \\pm \\sqrt2` against its two values. Answers
   that are words compare as words, ignoring case.

Bounded in time on any input, because reward code runs on whatever a policy writes; no signal
alarms, so it is bounded in threads and under torchrun alike: only the last TAIL characters are
read, every regex is linear (no nested quantifiers), only short strings are parsed as numbers or
expressions, the parser's nesting and every exact number's size are capped, there is no eval and
no sympy, and any exception scores 0.0.
"""

import cmath
import functools
import math
import re
import zlib
from fractions import Fraction

TAIL = 4096  # characters read from the end of a completion; the final answer sits at the end
MAX_NUM = 64  # longest string parsed as a plain number: keeps Fraction() and float() cheap
REL_TOL = 1e-6  # tolerance when a written decimal is involved (0.333333 vs 1/3)
SYM_TOL = 1e-9  # tolerance between two floating-point evaluations of exact forms (sqrt, pi, sin)
MAX_SYMBOLIC = 300  # longest normalised answer the symbolic path parses; MATH answers are < 100
MAX_DEPTH = 40  # parser nesting limit: recursion stays far below Python's
MAX_BITS = 4096  # an exact fraction larger than this falls back to floating point
MAX_ITEMS = 32  # longest list, set or matrix compared (element matching is quadratic)
POINTS = 3  # points at which expressions with variables are compared
MAX_CUES = 4  # `answer is` cues tried, from the last one back
CUE_SPAN = 200  # characters after a cue where its answer must be

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_TOKEN = re.compile(r"[^\s$]+")  # the argument of `\boxed 5`
_NUMBER = re.compile(r"(?:(?<![\w)\]}])-)?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)(?:/\d+)?")
# a number that stands on its own: not inside a word, a subscript or an exponent, not after `#`
_FREE_NUMBER = re.compile(r"(?<![\w.^#])(?<!_\{)(?<!\^\{)" + _NUMBER.pattern + r"(?!\w)(?!\.\d)")
_LIST_MARKER = re.compile(r"[.)][ \t]+\S")  # `2. Next` / `2) Next` at a line start
# `The answer is 7`, `Final answer: $x$`, `**Answer:** 7`: the rest of that line holds the answer
_CUE = re.compile(r"(?i)\banswer\b(?:\*\*)?(?:\s+is\b[ \t]*:?|[ \t]*[:=])[ \t]*(?:\*\*)?[ \t]*")
# where the answer's clause ends: `13 + 17 = 20, but ...`, `7. Then ...`, `10 which is ...`
_CLAUSE_END = re.compile(r"\.(?:\s|$)|[,;](?=\s)|\s(?:but|which|because|since|so)\s")
_WORD = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]{2,}")  # a word of two letters or more, not a \command
_WRAPPER = re.compile(r"\\(?:text|textbf|textit|textrm|mbox|mathrm|mathbf|mathit|operatorname)"
                      r"\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\\\|\\[,!;: ]|\\q?quad(?![a-zA-Z])|~")  # `\\` is a row break: kept
_DEGREES = re.compile(r"\^\s*(?:\{\s*\\circ\s*\}|\\circ)|\\circ|\\degrees?|°")
_UNIT_WORDS = (r"dollars?|cents?|units?|degrees?|radians?|percent"
               r"|inch(?:es)?|feet|foot|ft|yards?|miles?|meters?|metres?|cm|mm|km|centimeters?|kilometers?"
               r"|seconds?|minutes?|hours?|days?|weeks?|months?|years?|mph|pounds?|lbs?|ounces?|oz|kg|grams?"
               r"|liters?|litres?|gallons?")
_UNIT = re.compile(r"(?<=[\d} ]) ?(?:square |sq |cubic )?(?:" + _UNIT_WORDS + r")"
                   r"(?: per (?:hour|minute|second|day))?(?:\^\{?[23]\}?)?$")
# a one-letter unit (m, s, g, L) is only a unit inside \text{}: `5m` may be a product
_WRAPPED_UNIT = re.compile(r"(?<=[\d} ])\s*\\(?:text|mbox|mathrm)\s*\{\s*(?:square |cubic )?"
                           r"(?:m|s|g|L|h|ml|mL|" + _UNIT_WORDS + r")\s*\}(?:\^\s*\{?[23]\}?)?\s*$")
_UNICODE = {"\u2212": "-", "π": "\\pi ", "√": "\\sqrt", "×": "\\times ", "·": "\\cdot ", "∞": "\\infty ",
            "±": "\\pm ", "≤": "\\le ", "≥": "\\ge ", "∪": "\\cup "}
# a whole answer that is a number followed by words, e.g. "31 apples" (after \text{} unwrapping)
_NUMBER_WORDS = re.compile(r"^(-?[\d.,]+(?:/\d+)?) [a-zA-Z][a-zA-Z ]*$")
# `x =`, `AB =`, `\theta =`, `x \in` in front of the value
_ASSIGN = re.compile(r"^[A-Za-z\\][A-Za-z\\]{0,8}(?:_\{?\w{1,3}\}?)? ?(?:=|\\in(?![a-zA-Z])) ?")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL = re.compile(r"^-?(?:\d+\.\d*|\.\d+)$")
_INT_OR_DEC = re.compile(r"^-?(?:\d+(?:\.\d*)?|\.\d+)$")
_SLASH = re.compile(r"^(-?\d+)/(\d+)$")
# scientific notation: 6.72\times10^{-5}, 2.6 \cdot 10^4, 1.5e-3, 10^{5}
_SCI = re.compile(r"^(-?(?:\d+(?:\.\d*)?|\.\d+))(?:(?:\\times|\\cdot|\*)10\^\{?([-+]?\d{1,3})\}?"
                  r"|[eE]([-+]?\d{1,3}))$")
_POWER_OF_TEN = re.compile(r"^(-?)10\^\{?([-+]?\d{1,3})\}?$")
_FRAC = re.compile(r"^(-?)(\d+)?\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")  # also mixed: 1\frac{4}{5}
_HAS_DECIMAL = re.compile(r"\d\.\d|(?<!\d)\.\d")
_TEXT = re.compile(r"^[A-Za-z]{2,}$")  # an answer that is a word ("Evelyn", "east")


# ------------------------------------------------------------------ extraction

def _brace_pairs(s: str) -> dict[int, int]:
    """Index of each '{' -> index of its matching '}', in one pass; escaped \\{ \\} are skipped."""
    pairs, stack = {}, []
    for i, ch in enumerate(s):
        if ch in "{}" and i > 0 and s[i - 1] == "\\":
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            pairs[stack.pop()] = i
    return pairs


def _last_boxed(s: str) -> str | None:
    pairs = None
    for m in reversed(list(_BOXED.finditer(s))):
        j = m.end()
        while j < len(s) and s[j] == " ":
            j += 1
        if j < len(s) and s[j] == "{":
            pairs = _brace_pairs(s) if pairs is None else pairs
            if j in pairs and s[j + 1 : pairs[j]].strip():
                return s[j + 1 : pairs[j]]
            continue  # unbalanced (truncated) or empty (the prompt's `\boxed{}` echoed): skip it
        token = _TOKEN.match(s, j)  # `\boxed 5` form
        if token:
            return token.group(0)
    return None


def _free_numbers(s: str) -> list[str]:
    """The numbers of `s` that can be an answer, in order (see the module docstring, step 1)."""
    found = []
    for m in _FREE_NUMBER.finditer(s):
        a, b = m.span()
        if a > 0 and b < len(s) and s[a - 1] == "[" and s[b] == "]":
            continue  # a citation [1]
        line_start = s.rfind("\n", 0, a) + 1
        if not s[line_start:a].strip(" \t*-") and _LIST_MARKER.match(s, b):
            continue  # a list marker `2. Next` (a number alone on its line is still an answer)
        found.append(m.group())
    return found


def _result(expr: str) -> str:
    """`3 + 4 = 7` -> `7`: the end of a chain of arithmetic; `x = 5` and `2x + 3` stay whole."""
    head, eq, tail = expr.rpartition("=")
    return tail.strip() if eq and tail.strip() and not any(c.isalpha() for c in head) else expr


def _after_cue(s: str) -> str | None:
    """The answer after the last `answer is` / `Final answer:` cue, or None when there is none."""
    cues = list(_CUE.finditer(s))
    for m in reversed(cues[-MAX_CUES:]):
        line = s[m.end() : m.end() + CUE_SPAN].split("\n", 1)[0].strip().strip("*").strip()
        for open_, close in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if line.startswith(open_):
                inner = line[len(open_) :].split(close, 1)[0].strip()
                if inner:
                    return _result(inner)
                break
        line = _CLAUSE_END.split(line.replace("\\boxed{}", ""), maxsplit=1)[0].strip()
        tail = line.rpartition("=")[2].strip()  # `Tom has 4 + 9 = 13 shells` -> `13 shells`
        if not _WORD.search(line) and any(c.isdigit() for c in line):
            return _result(line)  # a bare expression: `7`, `2x + 3`, `\frac{1}{2}`, `3 + 4 = 7`
        numbers = _free_numbers(tail)
        if numbers:
            return numbers[0]  # `7 apples`: the number it names
    return None


def extract_answer(text: str) -> str | None:
    """The final answer written in `text` (a model completion or a worked solution), or None."""
    try:
        s = text[-TAIL:].replace("\u2212", "-")  # U+2212 minus sign, as some models write it
        boxed = _last_boxed(s)
        if boxed is not None:
            return boxed
        k = s.rfind("####")
        if k >= 0:
            after = s[k + 4 :].strip().split("\n")[0].strip()
            if after:
                return after
        cued = _after_cue(s)
        if cued is not None:
            return cued
        numbers = _free_numbers(s)
        return numbers[-1] if numbers else None
    except Exception:
        return None


# ------------------------------------------------------------------ normalisation (text rules)

def normalize(s: str, strip_assignment: bool = True) -> str:
    """A canonical text form of an answer; two answers that print the same are equal.

    strip_assignment: `x = 5` -> `5`, `y = 2x + 3` -> `2x + 3` (False keeps the equation whole)."""
    s = re.sub(r"\s+", " ", s[:TAIL]).strip()  # one space at most: the regexes below stay linear
    s = s.replace("{,}", ",")  # 10{,}080: a thousands separator
    for u, latex in _UNICODE.items():
        if u in s:
            s = s.replace(u, latex)
    s = _WRAPPED_UNIT.sub("", s)  # 5 \text{ m}^2 -> 5
    s = _WRAPPER.sub(r"\1", s)  # \text{ cm} -> " cm": keep the content, units go below
    s = re.sub(r"\\[dtc]frac(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r"\\(?:left|right|displaystyle|big|Big)(?![a-zA-Z])", "", s)
    s = _SPACING.sub(lambda m: m[0] if m[0] == "\\\\" else " ", s)
    s = s.replace("\\$", "").replace("$", "")
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"\s+", " ", s).strip()  # collapse spaces first: the unit regex must stay linear
    s = s.rstrip(".").strip()
    s = _UNIT.sub("", s).strip()
    s = _NUMBER_WORDS.sub(r"\1", s)
    m = _ASSIGN.match(s) if strip_assignment else None
    if m and "=" not in s[m.end() :] and m.end() < len(s):
        s = s[m.end() :]
    elif strip_assignment:
        s = _result(s)  # \boxed{8 + 2 = 10}: the value the arithmetic comes to
    # \frac12 = \frac{1}{2}, \frac{270}7, \frac9{19}, \sqrt2 = \sqrt{2}: LaTeX takes one token
    s = re.sub(r"\\frac ?(\d) ?(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac ?(\d) ?\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\} ?(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt ?(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = re.sub(r"([_^])\{(\w)\}", r"\1\2", s)  # 4210_{5} = 4210_5, x^{2} = x^2
    if len(s) > 2 and s[0] == "{" and _brace_pairs(s).get(0) == len(s) - 1:
        s = s[1:-1]
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = re.sub(r"^\(([A-Ea-e])\)$", r"\1", s)  # multiple choice: (C) = C
    if _DECIMAL.match(s):  # 2.50 -> 2.5, 3.0 -> 3, .5 -> 0.5
        s = s.rstrip("0").rstrip(".")
        s = ("-0" + s[1:] if s.startswith("-.") else "0" + s if s.startswith(".") else s) or "0"
    return s


def _number(s: str) -> Fraction | None:
    """The exact value of a normalised numeric answer, or None when it is not a plain number."""
    if len(s) > MAX_NUM:
        return None
    try:
        if _INT_OR_DEC.match(s):
            return Fraction(s)
        m = _SLASH.match(s)
        if m:
            return Fraction(int(m[1]), int(m[2]))
        m = _FRAC.match(s)
        if m:
            value = Fraction(m[3]) / Fraction(m[4])
            if m[2]:  # mixed number: 1\frac{4}{5} = 1 + 4/5
                value = int(m[2]) + value
            return -value if m[1] else value
        m = _SCI.match(s)
        if m:
            return Fraction(m[1]) * Fraction(10) ** int(m[2] or m[3])
        m = _POWER_OF_TEN.match(s)
        if m:
            return (-1 if m[1] else 1) * Fraction(10) ** int(m[2])
    except (ValueError, ZeroDivisionError):
        pass
    return None


# ------------------------------------------------------------------ symbolic path: parse

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


# ------------------------------------------------------------------ symbolic path: evaluate

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


def _symbolic_same(a: str, b: str) -> bool:
    if _TEXT.match(a) or _TEXT.match(b):  # words compare as words: "East" is "east", not e*a*s*t
        return bool(_TEXT.match(a) and _TEXT.match(b)) and a.casefold() == b.casefold()
    ta, tb = _parse(a), _parse(b)
    if ta is None or tb is None:
        return False
    names = _names(ta, set()) | _names(tb, set())
    envs = [_point(names, k) for k in range(POINTS)] if names else [{}]
    loose = bool(_HAS_DECIMAL.search(a) or _HAS_DECIMAL.search(b))
    return _Compare(envs, loose).same(ta, tb)


# ------------------------------------------------------------------ comparison

def _same(a: str, b: str) -> bool:
    if a == b:
        return a != ""
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        if x.denominator == 1 and y.denominator == 1:
            return x == y  # integers must match exactly: 27648 is not 27649
        return x == y or math.isclose(float(x), float(y), rel_tol=REL_TOL)
    if x is not None or y is not None:
        # our choice: a plain number only equals a plain number; `3+4` or `\sqrt{49}` against 7
        # would pay a policy for echoing the question's arithmetic instead of doing it
        return False
    return _symbolic_same(a, b)


def is_equiv(a: str, b: str) -> bool:
    """Whether two extracted answers are the same answer."""
    try:
        if _same(normalize(a), normalize(b)):
            return True
        # `y = 2x + 3` against `2x - y + 3 = 0`: compare the whole equations
        return ("=" in a or "=" in b) and _same(normalize(a, False), normalize(b, False))
    except Exception:
        return False


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


def answer_key(s: str) -> str:
    """A hashable form under which equivalent answers agree (for majority voting)."""
    try:
        n = normalize(s)
        x = _number(n)
        if x is not None:
            return str(x)
        if _TEXT.match(n):
            return n.casefold()
        tree = _parse(n)
        if tree is not None:
            try:
                names = _names(tree, set())
                return ",".join(sorted(names)) + ":" + _key(tree, _point(names, 0))
            except Exception:  # an equation, a base-b number, a pole: keyed by its text
                pass
        return n
    except Exception:
        return s


def score(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer is equivalent to `answer`, else 0.0. Never raises."""
    try:
        found = extract_answer(completion)
        return 1.0 if found is not None and is_equiv(found, str(answer)) else 0.0
    except Exception:
        return 0.0
