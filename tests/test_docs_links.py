"""The documentation has no dangling references: every relative link of README.md, BENCHMARKS.md and
docs/*.md names a file or directory of the repository, every `#anchor` names a heading of its page
(as GitHub renders heading anchors), and no code comment cites a document the repository lacks."""
import pathlib
import re
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
# a document named in code: a path ending in .md, or a bare design-doc citation such as "DESIGN §4"
MD_PATH = re.compile(r"(?<![\w/.-])([\w./-]+\.md)\b")
BARE_DESIGN = re.compile(r"\bDESIGN\b")
MD_ANCHOR = re.compile(r"(?<![\w/.-])([\w./-]+\.md)#([\w-]+)")


def pages():
    return [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]


def prose(text):
    """The page without fenced code blocks (a `#` line there is a comment, a `](` a string)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text):
    """Every heading anchor of a page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen, out = {}, set()
    for line in prose(text).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            base = slug(match.group(1))
            out.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return out


def dangling_links(page, text):
    """'page: target (why)' for each relative link of `text` (a page at `page`) that does not resolve."""
    bad = []
    for target in LINK.findall(INLINE_CODE.sub("", prose(text))):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not ours to check
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve()
        if path and not resolved.exists():
            bad.append(f"{page.name}: {target} (no such file)")
            continue
        headings = anchors(resolved.read_text() if path else text) if resolved.suffix == ".md" or not path else set()
        if anchor and anchor not in headings:
            bad.append(f"{page.name}: {target} (no such section)")
    return bad


def cited_documents(source):
    """'why' for each document a code file cites that the repository does not have."""
    bad = [f"{m} (no such file)" for m in MD_PATH.findall(source) if not (REPO / m).exists()]
    bad += [f"{m}#{a} (no such section)" for m, a in MD_ANCHOR.findall(source)
            if (REPO / m).exists() and a not in anchors((REPO / m).read_text())]
    bad += ["DESIGN (no such document: cite docs/design.md#section)" for _ in BARE_DESIGN.findall(source)]
    return bad


def test_every_relative_link_and_section_anchor_of_the_docs_exists():
    bad = [b for page in pages() for b in dangling_links(page, page.read_text())]
    assert bad == []


def test_every_png_in_docs_is_shown_by_some_page():
    shown = {(page.parent / t.partition("#")[0]).resolve() for page in pages() for t in LINK.findall(page.read_text())}
    assert [p.name for p in sorted((REPO / "docs").glob("*.png")) if p.resolve() not in shown] == []


def test_no_code_comment_cites_a_document_the_repository_lacks():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    bad = {f: cited_documents((REPO / f).read_text()) for f in files.split()
           if f != "tests/test_docs_links.py" and (REPO / f).exists()}
    assert {f: b for f, b in bad.items() if b} == {}


def test_a_missing_file_a_missing_section_and_a_bare_design_citation_are_reported():  # negative controls
    page = REPO / "docs" / "page.md"
    text = ("# Title\n## Some section (CPU)\n[ok](../README.md) [ok](#some-section-cpu) [ok](https://x.org/y)\n"
            "[gone](no_such_file.md) [gone](#no-section) [gone](../BENCHMARKS.md#no-such-benchmark)\n"
            "```\n# comment, not a heading\n[in code](nowhere.md)\n```\n`[inline](nowhere.md)`\n")
    assert dangling_links(page, text) == ["page.md: no_such_file.md (no such file)", "page.md: #no-section (no such section)",
                                          "page.md: ../BENCHMARKS.md#no-such-benchmark (no such section)"]
    assert cited_documents("x = 1  # see " + "DES" + "IGN §4 and docs/none.md\nKEPT_BY_DESIGN = 1\n") == [
        "docs/none.md (no such file)", "DESIGN (no such document: cite docs/design.md#section)"]
    assert cited_documents("# docs/design.md#no-such-part\n") == ["docs/design.md#no-such-part (no such section)"]


def test_anchors_follow_githubs_rule_for_punctuation_and_repeats():
    text = "## Online drift on vLLM: target-only vs target + draft sync (CPU)\n## bf16 (`--bf16`)\n## A\n## A\n"
    assert anchors(text) == {"online-drift-on-vllm-target-only-vs-target--draft-sync-cpu", "bf16---bf16", "a", "a-1"}
