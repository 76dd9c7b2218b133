"""README.zh-CN.md tells a Chinese reader only what this repository does.

Every `make <target>` it gives is a Makefile target that README.md names too, every `python -m helpers <sub>` is a
subcommand the helpers CLI accepts, every file it names in code exists, every command of README.md's code blocks is
in it, its section for readers in China names the mirror variable, the CPU wheel index, the CIFAR-10 folder and the
blog post the course started from, and it keeps a space between Chinese text and code or Latin words. Each check is
a function that is also fed a broken text here, so a check that cannot fail is caught too. (Its word choices are held
by tests/test_zh_terms.py.)
"""
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ZH_README = ROOT / "README.zh-CN.md"
EN_README = ROOT / "README.md"
MAKEFILE = ROOT / "Makefile"

CJK = "\u4e00-\u9fff"
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
# What the China section must name (the blog by the start of its title, which is in Chinese).
CHINA_SECTION_NAMES = {
    "the pip mirror variable": "PIP_INDEX_URL",
    "PyTorch's CPU wheel index": "https://download.pytorch.org/whl/cpu",
    "the CIFAR-10 folder the course reads": "data/cifar-10-batches-py",
    "the blog post the course started from": "零基础玩转分布式训练",
    "NVIDIA's driver table": "https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/",
    "how to see the driver": "nvidia-smi",
    "how to see torch's CUDA build": "torch.version.cuda, torch.cuda.is_available()",
}
# Folders of this repository whose files the README names.
REPO_FOLDERS = ("course", "tests", "helpers", "benchmarks", "notebooks", "translations")


# --- reading a README ---

def fenced_blocks(text: str) -> list[str]:
    return FENCE.findall(text)


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


def code_chunks(text: str) -> list[str]:
    """Every line of every fenced code block, and every inline code span outside them."""
    lines = [line for block in fenced_blocks(text) for line in block.splitlines()]
    return lines + INLINE.findall(prose(text))


def strip_comment(line: str) -> str:
    """A shell line without its comment: from a # that starts a word outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def make_targets_named(text: str) -> set[str]:
    """The targets of every `make ...` command in the text's code (variables like NPROCS=... are not targets)."""
    targets = set()
    for chunk in code_chunks(text):
        for command in re.split(r"&&|\|\||;|\|", strip_comment(chunk)):
            for m in re.finditer(r"(?<![\w./-])make\s+(.*)", command):
                try:
                    words = shlex.split(m.group(1))
                except ValueError:
                    words = m.group(1).split()
                for word in words:
                    if "=" in word or word.startswith("-"):
                        continue
                    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*", word):
                        break
                    targets.add(word)
    return targets


def makefile_targets(makefile: str) -> set[str]:
    """The rule targets the Makefile defines (not its variables, not $(STAMP), not .PHONY)."""
    targets = set()
    for line in makefile.splitlines():
        m = re.match(r"([A-Za-z0-9][\w-]*(?:[ \t]+[A-Za-z0-9][\w-]*)*)[ \t]*:(?!=)", line)
        if m:
            targets.update(m.group(1).split())
    return targets


def helpers_subcommands_named(text: str) -> set[str]:
    """The subcommand of every `python -m helpers <sub>` in the text's code (not `python -m helpers.x.y`)."""
    return {m.group(1) for chunk in code_chunks(text)
            for m in re.finditer(r"(?<![\w.-])python[\d.]*\s+-m\s+helpers\s+([^\s`]+)", chunk)}


def cli_refuses(subcommand: str) -> bool:
    """True if `python -m helpers <subcommand> --help` is refused by the CLI's own parser (an unknown subcommand)."""
    from helpers.notebook import runner

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), pytest.raises(SystemExit) as ended:
        runner.main([subcommand, "--help"])
    return ended.value.code != 0


def china_section(text: str) -> str:
    """The section whose heading names readers in China (国内读者), up to the next section of the same level."""
    m = re.search(r"^## [^\n]*国内读者[^\n]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    return m.group(0) if m else ""


def china_section_missing(text: str) -> list[str]:
    section = china_section(text)
    return [what for what, name in CHINA_SECTION_NAMES.items() if name not in section]


def spacing_problems(text: str) -> list[str]:
    """Chinese text written against code or a Latin word, without the space the rest of the file keeps.

    Titles in 《》 are quoted as they are written, so they are left out.
    """
    text = re.sub(r"《[^》]*》", "《》", prose(text))
    bad = rf"[{CJK}][A-Za-z0-9`]|[A-Za-z0-9`][{CJK}]"
    return [text[max(0, m.start() - 10):m.end() + 10].replace("\n", " ") for m in re.finditer(bad, text)]


def halfwidth_punctuation_problems(text: str) -> list[str]:
    """Half-width , ; : ( ) next to Chinese text, outside code (Chinese text takes ，；：（）)."""
    text = re.sub(r"\]\([^)\s]*\)", "]", INLINE.sub("`code`", prose(text)))   # a link's (target) is markdown
    bad = rf"[{CJK}][,;:()]|[,;:()][{CJK}]"
    return [text[max(0, m.start() - 10):m.end() + 10].replace("\n", " ") for m in re.finditer(bad, text)]


def missing_repo_paths(text: str, root: Path = ROOT) -> list[str]:
    """Files and folders of this repository named in the text's code that do not exist (patterns are skipped)."""
    missing = []
    for chunk in code_chunks(text):
        for m in re.finditer(rf"(?<![\w./-])((?:{'|'.join(REPO_FOLDERS)})/[\w./-]*)", chunk):
            path, after = m.group(1).rstrip("."), chunk[m.end():m.end() + 1]
            if after in {"*", "<"} or "..." in m.group(1) or "NN_" in path:
                continue
            if not (root / path).exists():
                missing.append(path)
    return missing


def commands(text: str) -> set[str]:
    """The command lines of the text's fenced blocks, without comments or spacing, for comparing two READMEs."""
    found = set()
    for block in fenced_blocks(text):
        for line in block.splitlines():
            line = " ".join(strip_comment(line).split())
            if line:
                found.add(line)
    return found


# --- the checks find what they are for ---

FAKE = """# 假的 README

```bash
make course   # 注释里的 make nothing 不算
make nosuchtarget
python -m helpers nosuchsub
PIP_INDEX_URL=https://example.org/simple make setup
```

也可以 `make alsobogus`，或者 `make matrix NOTEBOOKS="01 02" NPROCS="1 3"`，再看 `course/no_such_script.py`。
在`make`里少了空格，数据在data目录里，括号是半角的(像这样)。

## 国内读者须知

这里只写了 PIP_INDEX_URL。
"""


def test_readme_checks_flag_a_broken_readme():
    targets = make_targets_named(FAKE)
    assert {"nosuchtarget", "alsobogus"} <= targets and {"course", "setup", "matrix"} <= targets
    assert "nothing" not in targets and not any("=" in t for t in targets)
    known = makefile_targets(MAKEFILE.read_text())
    assert sorted(targets - known) == ["alsobogus", "nosuchtarget"]

    assert helpers_subcommands_named(FAKE) == {"nosuchsub"}
    assert cli_refuses("nosuchsub") and not cli_refuses("env")

    missing = china_section_missing(FAKE)
    assert "the pip mirror variable" not in missing
    assert {"PyTorch's CPU wheel index", "the CIFAR-10 folder the course reads",
            "the blog post the course started from"} <= set(missing)
    assert china_section_missing("# 没有这一节\n\nPIP_INDEX_URL data/cifar-10-batches-py") == list(CHINA_SECTION_NAMES)

    assert len(spacing_problems(FAKE)) == 4, spacing_problems(FAKE)   # 在`make、`make`里、在data、data目
    assert spacing_problems("在 `make` 里，数据在 data 目录里；《用PyTorch镜像》照原样引用") == []
    assert len(halfwidth_punctuation_problems(FAKE)) == 2, halfwidth_punctuation_problems(FAKE)
    assert halfwidth_punctuation_problems("全角的（像这样），`a, b` 和 [链接](https://x.org/)里的不算") == []

    assert missing_repo_paths(FAKE) == ["course/no_such_script.py"]
    assert missing_repo_paths("`course/ddp_cifar10.py`、`course/...`、`translations/zh_CN/*.po`、`notebooks/zh/NN_x`") == []

    assert make_targets_named("`make setup && make lab`") == {"setup", "lab"}
    assert strip_comment('A="x # y" make course  # why') == 'A="x # y" make course  '
    english = "```bash\nmake course   # run it\n.venv/bin/torchrun --nproc-per-node 2 course/gone.py\n```\n"
    assert commands(english) - commands(FAKE) == {".venv/bin/torchrun --nproc-per-node 2 course/gone.py"}


def test_readme_makefile_parser_reads_the_rules_and_nothing_else():
    makefile = MAKEFILE.read_text()
    targets = makefile_targets(makefile)
    phony = set(re.search(r"^\.PHONY:(.*)$", makefile, re.M).group(1).split())
    assert phony <= targets, phony - targets
    assert not targets & {"PY", "VENV", "FAST", "STAMP", "LAB_ZH", "PHONY", "ifneq"}


# --- the checks hold over README.zh-CN.md ---

def test_readme_zh_make_targets_exist_in_the_makefile():
    targets = make_targets_named(ZH_README.read_text(encoding="utf-8"))
    assert {"course", "test", "check", "setup", "lab-zh"} <= targets, targets
    assert sorted(targets - makefile_targets(MAKEFILE.read_text())) == []


def test_readme_zh_make_targets_are_ones_the_english_readme_names():
    zh = make_targets_named(ZH_README.read_text(encoding="utf-8"))
    en = make_targets_named(EN_README.read_text(encoding="utf-8"))
    assert sorted(zh - en) == []


def test_readme_zh_helpers_subcommands_are_accepted_by_the_cli():
    assert "from .notebook.runner import main" in (ROOT / "helpers" / "__main__.py").read_text()
    named = helpers_subcommands_named(ZH_README.read_text(encoding="utf-8"))
    assert named, "README.zh-CN.md names no `python -m helpers <sub>`"
    assert sorted(s for s in named if cli_refuses(s)) == []


def test_readme_zh_has_every_command_of_the_english_readme():
    missing = commands(EN_README.read_text(encoding="utf-8")) - commands(ZH_README.read_text(encoding="utf-8"))
    assert sorted(missing) == []


def test_readme_zh_china_section_names_what_a_reader_in_china_needs():
    text = ZH_README.read_text(encoding="utf-8")
    assert china_section(text), "README.zh-CN.md has no section for readers in China (## 国内读者须知 ...)"
    assert china_section_missing(text) == []


def test_readme_zh_files_it_names_exist():
    assert missing_repo_paths(ZH_README.read_text(encoding="utf-8")) == []


def test_readme_zh_keeps_a_space_between_chinese_and_code():
    assert spacing_problems(ZH_README.read_text(encoding="utf-8")) == []


def test_readme_zh_uses_fullwidth_punctuation_in_chinese_text():
    assert halfwidth_punctuation_problems(ZH_README.read_text(encoding="utf-8")) == []
