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
   Answers that are words compare as words, ignoring case. When neither side is a plain number
   nor a word and the text rules say no, a small symbolic path decides (~1 ms; common/symbolic.py):
   both sides are parsed into expression trees (sums, products, powers, roots, \\pi, i, functions,
   ±) and structures (tuples, intervals, unions, unordered lists and sets, matrices, equations) and
   evaluated, exactly with fractions where the values are rational and in complex floating point
   otherwise, at a few fixed points for the variables. Equal at every point is equal: sums in
   another order, factored forms, other spellings of a surd or of \\pi, complex numbers, solution
   lists in another order, `1 \\pm \\sqrt2` against its two values.

Bounded in time on any input, because reward code runs on whatever a policy writes; no signal
alarms, so it is bounded in threads and under torchrun alike: only the last TAIL characters are
read, every regex is linear (no nested quantifiers), only short strings are parsed as numbers or
expressions, the parser's nesting and every exact number's size are capped, there is no eval and
no sympy, and any exception scores 0.0.
"""

import math
import re
from fractions import Fraction

from common import symbolic
from common.symbolic import REL_TOL

TAIL = 4096  # characters read from the end of a completion; the final answer sits at the end
MAX_NUM = 64  # longest string parsed as a plain number: keeps Fraction() and float() cheap
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
_CLAUSE_END = re.compile(r"[.!?](?:\s|$)|[,;](?=\s)|\s(?:but|which|because|since|so)\s")
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
# a one-letter unit (m, s, g, L) is only a unit inside \text{} (after a digit, a space or \,): `5m` may be a product
_WRAPPED_UNIT = re.compile(r"(?:(?<=[\d} ])|(?<=\\[,;:!]))\s*\\(?:text|mbox|mathrm)\s*\{\s*(?:square |cubic )?"
                           r"(?:m|s|g|L|h|ml|mL|" + _UNIT_WORDS + r")\s*\}(?:\^\s*\{?[23]\}?)?\s*$")
_UNICODE = {"\u2212": "-", "π": "\\pi ", "√": "\\sqrt", "×": "\\times ", "·": "\\cdot ", "∞": "\\infty ",
            "±": "\\pm ", "≤": "\\le ", "≥": "\\ge ", "∪": "\\cup "}
# a whole answer that is a number followed by words, e.g. "31 apples" (after \text{} unwrapping)
# (a word of two letters or more: `3 x` or `2 i` is a product, not "3 of x")
_NUMBER_WORDS = re.compile(r"^(-?[\d.,]+(?:/\d+)?) [a-zA-Z]{2,}[a-zA-Z ]*$")
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
        # bold closes after the clause's full stop too: `is **18**.` -> `18`
        line = _CLAUSE_END.split(line.replace("\\boxed{}", ""), maxsplit=1)[0].strip().strip("*").strip()
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
    listed = ", " in s  # `2, 500` is a list of two numbers; a thousands separator is not followed by a space
    s = s.replace("{,}", ",")  # 10{,}080 (or 11,\! 111 below): a thousands separator
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
    if _THOUSANDS.match(s) and not listed:
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


# ------------------------------------------------------------------ comparison

def _same(a: str, b: str) -> bool:
    if a == b:
        return a != ""
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        if "." not in a + b:
            return x == y  # integers and fractions must match exactly: 27648 is not 27649, 1/999999 not 1/10^6
        return x == y or math.isclose(float(x), float(y), rel_tol=REL_TOL)  # a decimal may be rounded
    if x is not None or y is not None:
        # our choice: a plain number only equals a plain number; `3+4` or `\sqrt{49}` against 7
        # would pay a policy for echoing the question's arithmetic instead of doing it
        return False
    if _TEXT.match(a) or _TEXT.match(b):  # words compare as words: "East" is "east", not e*a*s*t
        return bool(_TEXT.match(a) and _TEXT.match(b)) and a.casefold() == b.casefold()
    return symbolic.same(a, b)


def is_equiv(a: str, b: str) -> bool:
    """Whether two extracted answers are the same answer."""
    try:
        if _same(normalize(a), normalize(b)):
            return True
        # `y = 2x + 3` against `2x - y + 3 = 0`: compare the whole equations
        return ("=" in a or "=" in b) and _same(normalize(a, False), normalize(b, False))
    except Exception:
        return False


def answer_key(s: str) -> str:
    """A hashable form under which equivalent answers agree (for majority voting)."""
    try:
        n = normalize(s)
        x = _number(n)
        if x is not None:
            return str(x)
        if _TEXT.match(n):
            return n.casefold()
        return symbolic.key(n) or n
    except Exception:
        return s


def score(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer is equivalent to `answer`, else 0.0. Never raises."""
    try:
        found = extract_answer(completion)
        return 1.0 if found is not None and is_equiv(found, str(answer)) else 0.0
    except Exception:
        return 0.0
