"""Plain text from LaTeX, as pylatexenc 2's ``LatexNodes2Text().latex_to_text`` gives it, for
the LaTeX that math answers use. The PRM800K grader (``prm800k``) turns a LaTeX answer into
text with pylatexenc before it compares strings or asks sympy; megarl's environment has no
pylatexenc, so this module does the same conversion itself.

What it reproduces (pylatexenc 2.11's default settings): its tokenizer (macros, whose name
swallows the spaces after it; groups; comments; ``$``/``\\(``/``\\[`` math; environments; the
specials ``&``, ``~``, ````` ``, ``''``, ``--``, ``---``); its argument reading (a mandatory
argument is one group, one macro or one character; ``\\frac12``, ``\\sqrt[3]x``); its tolerant
recovery (a stray ``}`` or ``\\end`` dropped, an unclosed group closed at the end, a macro
whose arguments run past the end left without them); and its rendering: ``\\frac{a}{b}`` ->
``a/b`` (no parentheses), ``\\sqrt{x}`` -> ``√(x)`` (a ``\\sqrt`` with no argument raises
KeyError, as pylatexenc's does), ``\\text``/``\\mathrm``/``\\textbf`` -> their argument,
``\\mathbf``/``\\mathbb``/... -> Unicode math letters, accents -> combining characters, matrices
-> ``[ a b; c d ]``, math blocks indented on their own lines, and a macro it does not know ->
nothing (its braced argument stays, as a group).

What it leaves out: pylatexenc's table has ~1,100 macros; this one has its base set (Greek,
relations, operators, arrows, dots, spacing, functions, text symbols) and the ~80 further
symbols that turn up in answers (``\\angle``, ``\\Rightarrow``, ``\\lfloor``, ``\\cong``, ...). A
macro outside it gives nothing here where pylatexenc gives its symbol; answers compared
after conversion still match each other when both use it. ``\\input``, ``\\cite``-style macros,
sectioning and ``\\title``, ``\\verb`` and text wrapping are not handled.
"""
from __future__ import annotations

import re
import unicodedata
from typing import NamedTuple, Optional

# -- what the tokenizer and argument reader know (pylatexenc's latexwalker defaults) ----------

# macros that take arguments: "{" mandatory, "[" optional, "*" an optional star
_ARGSPECS = {
    **dict.fromkeys(("documentclass", "usepackage", "RequirePackage", "selectlanguage",
                     "includegraphics", "footnote", "hphantom", "vphantom", "sqrt"), "[{"),
    **dict.fromkeys(("setlength", "addlength", "setcounter", "addcounter"), "[{{"),
    **dict.fromkeys(("newcommand", "renewcommand", "providecommand"), "*{[[{"),
    **dict.fromkeys(("newenvironment", "renewenvironment", "provideenvironment"), "*{[[{{"),
    "DeclareMathOperator": "*{{", "hspace": "*{", "vspace": "*{", "\\": "*[",
    **dict.fromkeys(("chapter", "section", "subsection", "subsubsection", "pagagraph",
                     "subparagraph"), "*[{"),
    **dict.fromkeys(("mbox", "title", "author", "date", "bibliography", "emph", "textrm",
                     "textit", "textbf", "textmd", "textsc", "textsf", "textsl", "texttt",
                     "textup", "text", "mathrm", "mathbb", "mathbf", "mathit", "mathsf",
                     "mathtt", "mathcal", "mathscr", "mathfrak", "label", "ref", "autoref",
                     "cref", "Cref", "eqref", "url", "hypersetup", "keywords", "'", "`", '"',
                     "c", "^", "~", "H", "k", "=", "b", ".", "d", "r", "u", "v", "ensuremath",
                     "not", "vec", "dot", "hat", "check", "breve", "acute", "grave", "tilde",
                     "bar", "ddot", "overline", "underline", "widehat", "widetilde",
                     "wideparen", "overleftarrow", "overrightarrow", "overleftrightarrow",
                     "underleftarrow", "underrightarrow", "underleftrightarrow", "overbrace",
                     "underbrace", "overgroup", "undergroup", "overbracket", "underbracket",
                     "overlinesegment", "underlinesegment", "overleftharpoon",
                     "overrightharpoon", "ket", "bra", "input", "include"), "{"),
    **dict.fromkeys(("frac", "nicefrac", "braket", "ketbra", "texorpdfstring"), "{{"),
    "xleftarrow": "[{", "xrightarrow": "[{", "color": "[{", "pagecolor": "[{",
    "textcolor": "[{{", "colorbox": "[{{", "fcolorbox": "[{[{{",
}
_ENV_ARGSPECS = {"figure": "[", "figure*": "[", "table": "[", "table*": "[", "tabular": "{",
                 "tabular*": "{{", "tabularx": "{[{", "array": "[{", "alignat": "{",
                 "alignat*": "{", "enumerate": "[", "itemize": "[", "description": "["}
_MATH_ENVS = frozenset(("equation", "equation*", "eqnarray", "eqnarray*", "align", "align*",
                        "gather", "gather*", "flalign", "flalign*", "multline", "multline*",
                        "alignat", "alignat*", "split"))
_SPECIALS = {"&": "   ", "~": "\N{NO-BREAK SPACE}", "``": "\N{LEFT DOUBLE QUOTATION MARK}",
             "''": "\N{RIGHT DOUBLE QUOTATION MARK}", "--": "\N{EN DASH}",
             "---": "\N{EM DASH}", "!`": "\N{INVERTED EXCLAMATION MARK}",
             "?`": "\N{INVERTED QUESTION MARK}"}

# -- what each macro becomes (pylatexenc's latex2text defaults, the subset above) -------------

_SYMBOLS = dict(entry.split("=", 1) for entry in """
oe=œ OE=Œ ae=æ AE=Æ aa=å AA=Å o=ø O=Ø ss=ß L=Ł l=ł i=ı j=ȷ &=& $=$ {={ }=} %=% #=# _=_
textquoteleft=‘ textquoteright=’ textquotedblright=” textquotedblleft=“ textendash=–
textemdash=— textpm=± textmp=∓ texteuro=€ backslash=\\ textbackslash=\\ hbar=ħ ell=ℓ
forall=∀ complement=∁ partial=∂ exists=∃ nexists=∄ varnothing=∅ emptyset=∅ aleph=ℵ nabla=∇
in=∈ notin=∉ ni=∋ prod=∏ coprod=∐ sum=∑ setminus=∖ smallsetminus=∖ ast=∗ circ=∘ bullet=∙
propto=∝ infty=∞ parallel=∥ nparallel=∦ wedge=∧ vee=∨ cap=∩ cup=∪ int=∫ iint=∬ iiint=∭ oint=∮
sim=∼ backsim=∽ simeq=≃ approx=≈ neq=≠ equiv=≡ le=≤ ge=≥ leq=≤ geq=≥ leqslant=⩽ geqslant=⩾
leqq=≦ geqq=≧ lneqq=≨ gneqq=≩ ll=≪ gg=≫ nless=≮ ngtr=≯ nleq=≰ ngeq=≱ lesssim=≲ gtrsim=≳
lessgtr=≶ gtrless=≷ prec=≺ succ=≻ preceq=≼ succeq=≽ precsim=≾ succsim=≿ nprec=⊀ nsucc=⊁
subset=⊂ supset=⊃ subseteq=⊆ supseteq=⊇ nsubseteq=⊈ nsupseteq=⊉ subsetneq=⊊ supsetneq=⊋
cdot=· times=× otimes=⊗ oplus=⊕ bigotimes=⊗ bigoplus=⊕ cos=cos sin=sin tan=tan arccos=arccos
arcsin=arcsin arctan=arctan cosh=cosh sinh=sinh tanh=tanh arccosh=arccosh arcsinh=arcsinh
arctanh=arctanh ln=ln log=log exp=exp max=max min=min sup=sup inf=inf lim=lim prime=' dag=†
dagger=† pm=± mp=∓ !=
ldots=… cdots=⋯ ddots=⋱ iddots=⋰ vdots=⋮ dots=… dotsc=… dotsb=… dotsm=… dotsi=… dotso=…
langle=⟨ rangle=⟩ lvert=| rvert=| vert=| lVert=‖ rVert=‖ Vert=‖ mid=| nmid=∤ uparrow=↑
downarrow=↓ rightarrow=→ to=→ leftarrow=← longrightarrow=⟶ longleftarrow=⟵ varepsilon=ε
vartheta=ϑ varpi=ϖ varrho=ϱ varsigma=ς varphi=φ id=𝕀 Ident=𝕀
angle=∠ measuredangle=∡ sphericalangle=∢ rightangle=∟ square=□ blacksquare=▪ Rightarrow=⇒
Leftarrow=⇐ Leftrightarrow=⇔ leftrightarrow=↔ Longrightarrow=⟹ Longleftarrow=⟸
Longleftrightarrow=⟺ longleftrightarrow=⟷ mapsto=↦ longmapsto=⟼ hookrightarrow=↪
hookleftarrow=↩ Uparrow=⇑ Downarrow=⇓ updownarrow=↕ nearrow=↗ searrow=↘ nwarrow=↖ swarrow=↙
therefore=∴ because=∵ cong=≅ perp=⊥ top=⊤ vdash=⊢ dashv=⊣ div=÷ lnot=¬ textdegree=°
lfloor=⌊ rfloor=⌋ lceil=⌈ rceil=⌉ lbrace={ rbrace=} star=⋆ diamond=♢ bigcup=⋃ bigcap=⋂
bigwedge=⋀ bigvee=⋁ surd=√ asymp=≍ doteq=≐ approxeq=≊ triangleq=≜ uplus=⊎ sqcup=⊔ sqcap=⊓
sqsubset=⊏ sqsupset=⊐ sqsubseteq=⊑ sqsupseteq=⊒ odot=⊙ ominus=⊖ oslash=⊘ circledcirc=⊚
circledast=⊛ boxplus=⊞ boxminus=⊟ boxtimes=⊠ bigtriangleup=△ bigtriangledown=▽ vartriangle=▵
triangleright=▹ triangleleft=◃ lozenge=◊ bigcirc=◯ hslash=ℏ wp=℘ mho=℧ beth=ℶ gimel=ℷ
daleth=ℸ textonehalf=½ textonequarter=¼ textthreequarters=¾ textcelsius=℃ textdollar=$
textcent=¢ textsterling=£ textyen=¥ textsection=§ textparagraph=¶ textcopyright=©
textregistered=® texttimes=× textdiv=÷ textperthousand=‰ textbullet=• textellipsis=…
textdagger=† textdaggerdbl=‡ intercal=⊺ ltimes=⋉ rtimes=⋊ bowtie=⋈ lessdot=⋖ gtrdot=⋗
lesseqgtr=⋚ gtreqless=⋛ lessapprox=⪅ gtrapprox=⪆ lneq=⪇ gneq=⪈ subseteqq=⫅ supseteqq=⫆
eqslantless=⪕ eqslantgtr=⪖ Subset=⋐ Supset=⋑ Cap=⋒ Cup=⋓ pitchfork=⋔ twoheadrightarrow=↠
twoheadleftarrow=↞ rightleftharpoons=⇌ leftrightharpoons=⇋ leftharpoonup=↼ rightharpoonup=⇀
amalg=⨿ backprime=‵ frown=⌢ smile=⌣ textasciicircum=ˆ textasciitilde=~ textquotesingle='
textasciigrave=`
""".split())
# the ones whose text holds spaces (\, \; \: and "\ " are a space each), and \-
_SYMBOLS.update({",": " ", ";": " ", ":": " ", " ": " ", "quad": "  ", "qquad": "    ",
                 "limsup": "lim sup", "liminf": "lim inf", "-": "\N{SOFT HYPHEN}"})
for _name in ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
              "pi rho sigma tau upsilon phi chi psi omega").split():
    _upper = "LAMDA" if _name == "lambda" else _name.upper()
    _small = {"EPSILON": "GREEK LUNATE EPSILON SYMBOL",
              "PHI": "GREEK PHI SYMBOL"}.get(_upper, "GREEK SMALL LETTER " + _upper)
    _SYMBOLS[_name] = unicodedata.lookup(_small)
    _SYMBOLS[_name[0].upper() + _name[1:]] = unicodedata.lookup("GREEK CAPITAL LETTER " + _upper)

_FORMATS = {  # %s: the arguments in order; %(n)s: the n-th argument
    "frac": "%s/%s", "nicefrac": "%s/%s", "textfrac": "%s/%s", "sqrt": "\N{SQUARE ROOT}(%(2)s)",
    "ensuremath": "%s", "url": "<%s>", "footnote": "[%(2)s]", "textcolor": "%(3)s",
    "colorbox": "%(3)s", "fcolorbox": "%(5)s", "hspace": "", "vspace": "\n", "\\": "\n",
    "ket": "|%s⟩", "bra": "⟨%s|", "braket": "⟨%s|%s⟩", "ketbra": "|%s⟩⟨%s|",
    "ref": "<ref>", "autoref": "<ref>", "cref": "<ref>", "Cref": "<Ref>", "eqref": "(<ref>)",
    **dict.fromkeys(("overline", "underline", "widehat", "widetilde", "wideparen",
                     "overleftarrow", "overrightarrow", "overleftrightarrow", "underleftarrow",
                     "underrightarrow", "underleftrightarrow", "overbrace", "underbrace",
                     "overgroup", "undergroup", "overbracket", "underbracket",
                     "overlinesegment", "underlinesegment", "overleftharpoon",
                     "overrightharpoon"), "%s"),
}
_KEEP_ARGS = frozenset(("emph", "textrm", "textit", "textbf", "textsc", "textsl", "text",
                        "mathrm"))
_MATH_STYLES = {"mathbf": "bold", "mathit": "italic", "mathsf": "sans", "mathbb": "doublestruck",
                "mathtt": "monospace", "mathcal": "script", "mathscr": "script",
                "mathfrak": "fraktur"}
_STYLE_OFFSETS = {"bold": (0x1D400, 0x1D41A), "italic": (0x1D434, 0x1D44E),
                  "script": (0x1D49C, 0x1D4B6), "fraktur": (0x1D504, 0x1D51E),
                  "doublestruck": (0x1D538, 0x1D552), "sans": (0x1D5A0, 0x1D5BA),
                  "monospace": (0x1D670, 0x1D68A)}
_STYLE_HOLES = {"italic": {"h": "\u210e"},  # letters Unicode placed earlier
                "script": dict(zip("BEFHILMRego", "\u212c\u2130\u2131\u210b\u2110\u2112\u2133"
                                                  "\u211b\u212f\u210a\u2134")),
                "fraktur": dict(zip("CHIRZ", "\u212d\u210c\u2111\u211c\u2128")),
                "doublestruck": dict(zip("CHNPQRZ", "\u2102\u210d\u2115\u2119\u211a\u211d"
                                                    "\u2124"))}
_ACCENTS = {"'": "\u0301", "`": "\u0300", '"': "\u0308", "c": "\u0327", "^": "\u0302",
            "~": "\u0303", "H": "\u030b", "k": "\u0328", "=": "\u0304", "b": "\u0331",
            ".": "\u0307", "d": "\u0323", "r": "\u030a", "u": "\u0306", "v": "\u030c",
            "vec": "\u20d7", "dot": "\u0307", "hat": "\u0302", "check": "\u030c",
            "breve": "\u0306", "acute": "\u0301", "grave": "\u0300", "tilde": "\u0303",
            "bar": "\u0305", "ddot": "\u0308", "not": "\u0338"}
_MATRIX_ENVS = frozenset(("array", "pmatrix", "bmatrix", "smallmatrix", "psmallmatrix",
                          "bsmallmatrix"))
_DISPLAY_ENVS = frozenset(("equation", "equation*", "eqnarray", "eqnarray*", "align",
                           "multline", "gather", "align*", "multline*", "gather*", "dmath",
                           "dmath*"))
_CENTERED_ENVS = frozenset(("center", "flushleft", "flushright"))


# -- parsing ------------------------------------------------------------------------------------

class _Tok(NamedTuple):
    kind: str  # char macro comment brace_open brace_close math specials begin end
    arg: str
    pos: int
    len: int
    pre_space: str
    post_space: str = ""


class _End(Exception):
    def __init__(self, final_space: str = ""):
        super().__init__()
        self.final_space = final_space


class _ParseError(Exception):
    pass


class Node(NamedTuple):
    kind: str                      # chars group macro specials env math comment
    text: str = ""                 # chars; macro/env name; specials chars; comment post-space
    nodes: tuple = ()              # group / env / math contents
    args: Optional[tuple] = None   # macro/env arguments (None: could not be read)
    post_space: str = ""           # a macro's swallowed spaces
    display: bool = False          # math: display rather than inline
    argspec: str = ""


_ENV_NAME = re.compile(r"\s*\{([\w* ._-]+)\}")
_COMMENT_END = re.compile(r"(\n|\r|\n\r)(?P<extra>\s*)")  # and the spaces it keeps


class _Walker:
    def __init__(self, s: str):
        self.s = s

    def token(self, pos: int, braces: str = "{}", environments: bool = True,
              dollar_math: bool = False) -> _Tok:
        s, space = self.s, ""
        while pos < len(s) and s[pos].isspace():
            space += s[pos]
            pos += 1
            if space.endswith("\n\n"):  # a paragraph break is a character of its own
                return _Tok("char", "\n\n", pos - 2, 2, space[:-2])
        if pos >= len(s):
            raise _End(space)
        c = s[pos]
        if c == "\\":
            if pos + 1 >= len(s):
                raise _End()
            i = pos + 2
            if s[pos + 1].isalpha():
                while i < len(s) and s[i].isalpha():
                    i += 1
            name = s[pos + 1:i]
            if name in ("[", "]", "(", ")"):
                return _Tok("math", "\\" + name, pos, 2, space)
            if environments and name in ("begin", "end"):
                m = _ENV_NAME.match(s, i)
                if m is None:  # tolerated: the macro's text as characters
                    return _Tok("char", "\\" + name, pos, i - pos, space)
                return _Tok(name, m.group(1), pos, m.end() - pos, space)
            post = ""
            if name.isalpha():  # a control word swallows the spaces after it
                while i < len(s) and s[i].isspace():
                    post += s[i]
                    i += 1
                    if post.endswith("\n\n"):
                        post, i = post[:-2], i - 2
                        break
            return _Tok("macro", name, pos, i - pos, space, post)
        if c == "%":
            m = _COMMENT_END.search(s, pos)
            if m is None:
                return _Tok("comment", s[pos + 1:], pos, len(s) - pos, space, "")
            if m.group("extra").startswith(("\n", "\r", "\n\r")):
                return _Tok("comment", s[pos + 1:m.start()], pos, m.start() - pos, space, "")
            return _Tok("comment", s[pos + 1:m.start()], pos, m.end() - pos, space, m.group())
        if c in braces[0::2]:
            return _Tok("brace_open", c, pos, 1, space)
        if c in braces[1::2]:
            return _Tok("brace_close", c, pos, 1, space)
        if s.startswith("$$", pos) and not dollar_math:
            return _Tok("math", "$$", pos, 2, space)
        if c == "$":
            return _Tok("math", "$", pos, 1, space)
        special = max((k for k in _SPECIALS if s.startswith(k, pos)), key=len, default=None)
        if special is not None:
            return _Tok("specials", special, pos, len(special), space)
        return _Tok("char", c, pos, 1, space)

    def expression(self, pos: int, dollar_math: bool = False) -> tuple[Node, int]:
        """One argument: a group, a macro (without its own arguments), or one character."""
        tok = self.token(pos, environments=False, dollar_math=dollar_math)
        if tok.kind == "macro":
            if tok.arg == "end":
                return Node("chars"), tok.pos
            return Node("macro", tok.arg, post_space=tok.post_space), tok.pos + tok.len
        if tok.kind == "specials":
            return Node("specials", tok.arg), tok.pos + tok.len
        if tok.kind == "comment":
            return self.expression(tok.pos + tok.len, dollar_math)
        if tok.kind == "brace_open":
            return self.group(tok.pos, "{}", dollar_math)
        if tok.kind == "brace_close":
            return Node("chars"), tok.pos
        if tok.kind == "math" and tok.arg.startswith("\\"):
            return Node("macro", tok.arg), tok.pos + tok.len
        return Node("chars", tok.arg), tok.pos + tok.len

    def group(self, pos: int, braces: str, dollar_math: bool = False) -> tuple[Node, int]:
        first = self.token(pos, braces=braces if braces == "{}" else "{}" + braces)
        nodes, end = self.nodes(first.pos + first.len, stop_brace=braces,
                                dollar_math=dollar_math)
        return Node("group", nodes=tuple(nodes)), end

    def args(self, name: str, argspec: str, pos: int, dollar_math: bool
             ) -> tuple[Optional[tuple], int]:
        """The arguments of ``argspec`` from ``pos``; (None, pos) when the text ends first."""
        out, p = [], pos
        try:
            for kind in argspec:
                if kind == "{":
                    node, p = self.expression(p, dollar_math)
                    out.append(node)
                elif kind == "[":
                    if name == "\\" and p < len(self.s) and self.s[p].isspace():
                        out.append(None)  # "\\ [x]": no optional argument across a space
                        continue
                    try:
                        tok = self.token(p, braces="{}[]", environments=False)
                    except _End:
                        tok = None
                    if tok is None or tok.kind != "brace_open" or tok.arg != "[":
                        out.append(None)
                        continue
                    node, p = self.group(p, "[]", dollar_math)
                    out.append(node)
                else:  # "*"
                    tok = self.token(p)  # pylatexenc reads the star outside math
                    if tok.kind == "char" and tok.arg.startswith("*"):
                        out.append(Node("chars", "*"))
                        p = tok.pos + 1
                    else:
                        out.append(None)
        except _End:
            return None, pos
        return tuple(out), p

    def nodes(self, pos: int, stop_brace: Optional[str] = None, stop_env: Optional[str] = None,
              stop_math: Optional[str] = None, dollar_math: bool = False
              ) -> tuple[list[Node], int]:
        """Nodes from ``pos`` to the end of the text, or to the closing brace/environment/math
        delimiter asked for (consumed); returns them and the position after."""
        braces = "{}" if stop_brace in (None, "{}") else "{}" + stop_brace
        out: list[Node] = []
        chars: list[str] = []
        while True:
            try:
                done = self._read(pos, out, chars, braces, stop_brace, stop_env, stop_math,
                                  dollar_math)
            except _End as end:  # the text ends (an open group or environment with it)
                chars.append(end.final_space)
                done = (True, len(self.s))
            except _ParseError as err:  # tolerated: the offending token is dropped
                done = (False, err.args[0])
            stop, pos = done
            if stop:
                if chars and "".join(chars):
                    out.append(Node("chars", "".join(chars)))
                return out, pos

    def _read(self, pos, out, chars, braces, stop_brace, stop_env, stop_math, dollar_math):
        tok = self.token(pos, braces=braces, dollar_math=dollar_math)
        pos = tok.pos + tok.len
        if tok.kind == "char":
            chars.append(tok.pre_space + tok.arg)
            return False, pos
        if chars and "".join(chars):
            out.append(Node("chars", "".join(chars) + tok.pre_space))
            chars.clear()
        elif tok.pre_space:
            chars.clear()
            out.append(Node("chars", tok.pre_space))
        if tok.kind == "brace_close":
            if stop_brace is None or tok.arg != stop_brace[1]:
                raise _ParseError(pos)
            return True, pos
        if tok.kind == "end":
            if tok.arg != stop_env:
                raise _ParseError(pos)
            return True, pos
        if tok.kind == "math":
            if stop_math is not None and tok.arg == stop_math:
                return True, pos
            if tok.arg in ("\\)", "\\]"):
                raise _ParseError(pos)
            closing = {"\\(": "\\)", "\\[": "\\]"}.get(tok.arg, tok.arg)
            inner, pos = self.nodes(pos, stop_math=closing, dollar_math=tok.arg == "$")
            out.append(Node("math", nodes=tuple(inner), display=tok.arg not in ("\\(", "$")))
        elif tok.kind == "comment":
            out.append(Node("comment", tok.post_space))
        elif tok.kind == "brace_open":
            node, pos = self.group(tok.pos, "{}" if tok.arg == "{" else "[]", dollar_math)
            out.append(node)
        elif tok.kind == "begin":
            argspec = _ENV_ARGSPECS.get(tok.arg, "")
            args, pos = self.args(tok.arg, argspec, pos, dollar_math)
            inner, pos = self.nodes(pos, stop_env=tok.arg,
                                    dollar_math=dollar_math and tok.arg not in _MATH_ENVS)
            out.append(Node("env", tok.arg, tuple(inner), args, argspec=argspec))
        elif tok.kind == "macro":
            argspec = _ARGSPECS.get(tok.arg, "")
            args, pos = self.args(tok.arg, argspec, pos, dollar_math)
            if args is None:
                pos = tok.pos + tok.len
            out.append(Node("macro", tok.arg, args=args, post_space=tok.post_space,
                            argspec=argspec))
        else:  # specials
            out.append(Node("specials", tok.arg))
        return False, pos


# -- rendering -----------------------------------------------------------------------------

def _is_bare(node: Optional[Node]) -> bool:
    """A macro given no arguments, in pylatexenc's legacy view of them: an optional first
    argument (after any stars) followed only by mandatory ones, else all of them."""
    if node is None or node.kind != "macro":
        return False
    if node.args is None:
        return True
    stars = len(node.argspec) - len(node.argspec.lstrip("*"))
    rest = node.argspec[stars:]
    if rest[:1] == "[" and set(rest[1:]) <= {"{"}:
        return node.args[stars] is None and len(node.args) == stars + 1
    return len(node.args) == 0


class _Renderer:
    def __init__(self):
        self.math = False  # inside math: spaces as in the source (pylatexenc's 'in-equations')

    def nodelist(self, nodes) -> str:
        out, prev = [], None
        for node in nodes:
            if self.math and node.kind == "chars" and _is_bare(prev):
                out.append(prev.post_space)
            out.append(self.node(node))
            prev = node
        return "".join(out)

    def arg(self, node: Optional[Node]) -> str:
        if node is None:
            return ""
        return self.nodelist(node.nodes) if node.kind == "group" else self.node(node)

    def node(self, node: Node) -> str:
        kind = node.kind
        if kind == "chars":
            return "" if self.math and not node.text.strip() else node.text
        if kind == "comment":
            return node.text
        if kind == "group":
            return self.nodelist(node.nodes)
        if kind == "specials":
            return _SPECIALS[node.text]
        if kind == "math":
            return self.math_block(node.nodes, node.display)
        if kind == "env":
            return self.environment(node)
        return self.macro(node)

    def math_block(self, nodes, display: bool) -> str:
        outer, self.math = self.math, True
        try:
            content = self.nodelist(nodes).strip()
        finally:
            self.math = outer
        return "\n    " + content.replace("\n", "\n    ") + "\n" if display else content

    def macro(self, node: Node) -> str:
        name, args = node.text, node.args or ()
        if name in _SYMBOLS:
            return _SYMBOLS[name]
        if name in _FORMATS:
            return self.fill(_FORMATS[name], args, name)
        if name in _KEEP_ARGS:
            return "".join(self.arg(a) for a in args)
        if name in _MATH_STYLES:
            return _styled(self.arg(args[0]) if args else "", _MATH_STYLES[name])
        if name in _ACCENTS:
            chars = self.nodelist([args[0]]).strip() if args and args[0] is not None else " "
            return "".join(unicodedata.normalize("NFC", _dotless(c) + _ACCENTS[name])
                           for c in chars)
        if name == "%":
            return "%"
        if name == "texorpdfstring":  # the text version: the second argument
            return self.nodelist(args[1:2])
        return ""  # unknown (or known but dropped, like \label): nothing

    def fill(self, template: str, args, name: str) -> str:
        if "%" not in template:
            return template
        texts = [self.arg(a) for a in args]
        if re.search("(^|[^%])(%%)*%s", template):
            values = tuple(texts)
        else:
            values = {str(j + 1): t for j, t in enumerate(texts)}
        try:
            return template % values  # a KeyError (\sqrt without argument) is pylatexenc's
        except (TypeError, ValueError):
            return template  # pylatexenc warns and keeps the placeholders

    def environment(self, node: Node) -> str:
        name = node.text
        if name in _DISPLAY_ENVS:
            return self.math_block(node.nodes, display=True)
        if name in _MATRIX_ENVS:
            return self.matrix(node.nodes)
        if name in _CENTERED_ENVS:
            return "\n%s\n" % self.nodelist(node.nodes)
        return self.nodelist(node.nodes)

    def matrix(self, nodes) -> str:
        rows, row, cell = [], [], []

        def end_cell():
            if cell:
                row.append(self.nodelist(cell).strip())
            cell.clear()

        for n in nodes:
            if n.kind == "specials" and n.text == "&":
                end_cell()
            elif n.kind == "macro" and n.text == "\\":
                end_cell()
                rows.append(list(row))
                row.clear()
            else:
                cell.append(n)
        end_cell()
        rows.append(list(row))
        width = max(len(x) for r in rows for x in r)  # ValueError for an empty matrix, too
        return "[ " + "; ".join(" ".join(x.rjust(width) for x in r) for r in rows) + " ]"


def _dotless(c: str) -> str:
    return {"ı": "i", "ȷ": "j"}.get(c, c)


def _styled(text: str, style: str) -> str:
    upper, lower = _STYLE_OFFSETS[style]
    holes = _STYLE_HOLES.get(style, {})
    out = []
    for c in text:
        if c in holes:
            out.append(holes[c])
        elif "A" <= c <= "Z":
            out.append(chr(upper + ord(c) - ord("A")))
        elif "a" <= c <= "z":
            out.append(chr(lower + ord(c) - ord("a")))
        else:
            out.append(c)
    return "".join(out)


def latex_to_text(latex: str) -> str:
    """``latex`` as plain text, as ``pylatexenc.latex2text.LatexNodes2Text().latex_to_text``
    renders it (see the module docstring for the subset)."""
    nodes, _ = _Walker(latex).nodes(0)
    return _Renderer().nodelist(nodes)
