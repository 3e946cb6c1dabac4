"""Rule-based answer checking: the reward every algorithm in this repo trains on.

    score(completion, answer) -> 1.0 if the completion's final answer equals `answer`, else 0.0

1. Extract the final answer from the completion: the last non-empty \\boxed{...} (or \\fbox{...},
   `\\boxed 5`), else the text after the last `####`, else the last number. (Small models often
   echo the prompt's empty `\\boxed{}` after writing the answer; an empty box is no answer.)
2. Normalise both sides as text: LaTeX spacing, $ signs, \\text{}-style wrappers, \\left/\\right,
   units, degrees, percent, thousands separators, \\frac/\\sqrt shorthands, `x =` prefixes, ...
3. Compare: equal strings, or equal numbers (integers, decimals, a/b, \\frac{a}{b}, mixed numbers;
   exact, with a 1e-6 relative tolerance when a non-integer is involved), or equal element by
   element for simple tuples and intervals.

Bounded in time on any input, because reward code runs on whatever a policy writes: only the last
TAIL characters are read, every regex is linear (no nested quantifiers), only short strings are
parsed as numbers (no exponents), there is no eval and no sympy, and any exception scores 0.0.
"""

import math
import re
from fractions import Fraction

TAIL = 4096  # characters read from the end of a completion; the final answer sits at the end
MAX_NUM = 64  # longest string parsed as a number: keeps Fraction() and float() cheap
REL_TOL = 1e-6  # tolerance for numbers that are not both integers (0.333333 vs 1/3)

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_TOKEN = re.compile(r"[^\s$]+")  # the argument of `\boxed 5`
_NUMBER = re.compile(r"(?:(?<![\w)\]}])-)?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)(?:/\d+)?")
_WRAPPER = re.compile(r"\\(?:text|textbf|textit|textrm|mbox|mathrm|mathbf|mathit|operatorname)"
                      r"\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,!;: ]|\\q?quad(?![a-zA-Z])|~")
_DEGREES = re.compile(r"\^\s*(?:\{\s*\\circ\s*\}|\\circ)|\\circ|\\degrees?|°")
_UNIT = re.compile(
    r"(?<=[\d} ]) ?(?:square |sq |cubic )?(?:dollars?|cents?|units?|degrees?|radians?|percent"
    r"|inch(?:es)?|feet|foot|ft|yards?|miles?|meters?|metres?|cm|mm|km|centimeters?|kilometers?"
    r"|seconds?|minutes?|hours?|days?|weeks?|months?|years?|mph|pounds?|lbs?|ounces?|oz|kg|grams?"
    r"|liters?|litres?|gallons?)(?: per (?:hour|minute|second|day))?(?:\^\{?[23]\}?)?$"
)
# a whole answer that is a number followed by words, e.g. "31 apples" (after \text{} unwrapping)
_NUMBER_WORDS = re.compile(r"^(-?[\d.,]+(?:/\d+)?) [a-zA-Z][a-zA-Z ]*$")
# `x =`, `AB =`, `\theta =`, `x \in` in front of the value
_ASSIGN = re.compile(r"^[A-Za-z\\][A-Za-z\\]{0,8}(?:_\{?\w{1,3}\}?)? ?(?:=|\\in(?![a-zA-Z])) ?")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL = re.compile(r"^-?(?:\d+\.\d*|\.\d+)$")
_INT_OR_DEC = re.compile(r"^-?(?:\d+(?:\.\d*)?|\.\d+)$")
_SLASH = re.compile(r"^(-?\d+)/(\d+)$")
_FRAC = re.compile(r"^(-?)(\d+)?\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")  # also mixed: 1\frac{4}{5}


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
        numbers = _NUMBER.findall(s)
        return numbers[-1] if numbers else None
    except Exception:
        return None


def normalize(s: str) -> str:
    """A canonical text form of an answer; two answers that print the same are equal."""
    s = s[:TAIL].replace("\u2212", "-").strip()
    s = _WRAPPER.sub(r"\1", s)  # \text{ cm} -> " cm": keep the content, units go below
    s = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r"\\(?:left|right|displaystyle|big|Big)(?![a-zA-Z])", "", s)
    s = _SPACING.sub(" ", s)
    s = s.replace("\\$", "").replace("$", "")
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"\s+", " ", s).strip()  # collapse spaces first: the unit regex must stay linear
    s = s.rstrip(".").strip()
    s = _UNIT.sub("", s).strip()
    s = _NUMBER_WORDS.sub(r"\1", s)
    m = _ASSIGN.match(s)
    if m and "=" not in s[m.end() :] and m.end() < len(s):
        s = s[m.end() :]
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
    except (ValueError, ZeroDivisionError):
        pass
    return None


def _split_tuple(s: str) -> tuple[str, list[str], str] | None:
    """(open, elements, close) for `(1,2)`, `[a,b)`, `3,5,7`; None when there is no top-level comma."""
    open_, close = "", ""
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        open_, close, s = s[0], s[-1], s[1:-1]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return (open_, parts, close) if len(parts) > 1 else None


def _same(a: str, b: str, depth: int = 0) -> bool:
    if a == b:
        return a != ""
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        if x.denominator == 1 and y.denominator == 1:
            return x == y  # integers must match exactly: 27648 is not 27649
        return x == y or math.isclose(float(x), float(y), rel_tol=REL_TOL)
    if depth == 0:
        ta, tb = _split_tuple(a), _split_tuple(b)
        if ta and tb and ta[0] == tb[0] and ta[2] == tb[2] and len(ta[1]) == len(tb[1]):
            return all(_same(p, q, 1) for p, q in zip(ta[1], tb[1]))
    return False


def is_equiv(a: str, b: str) -> bool:
    """Whether two extracted answers are the same answer."""
    try:
        return _same(normalize(a), normalize(b))
    except Exception:
        return False


def answer_key(s: str) -> str:
    """A hashable form under which equivalent answers agree (for majority voting)."""
    try:
        n = normalize(s)
        x = _number(n)
        if x is not None:
            return str(x)
        t = _split_tuple(n)
        if t:
            parts = [str(v) if (v := _number(p)) is not None else p for p in t[1]]
            return t[0] + ",".join(parts) + t[2]
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
