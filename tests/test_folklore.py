"""The folklore table (tools/folklore.py): every trick of the three articles, its verdict computed from a claims log,
README's snapshot equal to the log it was built from; the glossary and each lesson's 中文 line. No lesson is run."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SEEDS = ROOT.parent / "shared" / "seeds"   # the workspace beside the checkout, where there is one
spec = importlib.util.spec_from_file_location("folklore", ROOT / "tools" / "folklore.py")
folklore = importlib.util.module_from_spec(spec)
spec.loader.exec_module(folklore)

DATA = folklore.load_data()
LESSONS = {p.name[:2]: p for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb") if not p.name.endswith(".blank.ipynb")}
ROWS = [(t, r) for t in DATA["tricks"] for r in t["rows"]]

# The tricks of each article, as its own headings number them (000, 001) or, for 004, the sections that make claims.
TRICKS = {
    "000": ["1. 合理配置资源分配", "2. 优化通信效率", "3. 选择合适的同步策略", "4. 监控与日志记录", "5. 处理数据分布不均",
            "6. 调整超参数", "7. 故障排查与恢复机制"],
    "001": ["神操作1：固定CUDA和PyTorch版本", "神操作2：强制指定NCCL作为通信后端", "神操作3：混合使用ZeRO-3 + Tensor Parallelism",
            "神操作4：全局设定随机种子", "神操作5：启用梯度裁剪", "神操作6：使用线性预热+余弦衰减", "神操作7：启用TensorBoard + 分布式日志聚合"],
    "004": ["什么是分布式训练", "PyTorch中分布式训练的框架与架构", "环境准备", "数据并行与模型并行", "分布式训练的代码示例",
            "分布式训练中的性能优化", "常见问题及解决方案"],
}
# The figures the articles give, each in some row's claim.
FIGURES = ["8 × 32 = 256", "(4)", "3×", "50%", "40%", "2.1.0", "NCCL 2.18", "(42)", "max_norm 1.0", "3 cycles", "1000 steps", "patience 5"]


def test_every_trick_of_the_three_articles_has_a_row_under_its_articles_title():
    for article, titles in TRICKS.items():
        have = [t["title"] for t in DATA["tricks"] if t["article"] == article]
        assert have == titles, f"article {article}"
    assert set(DATA["articles"]) == set(TRICKS)
    claims = " ".join(r["claim"] for _, r in ROWS)
    assert [f for f in FIGURES if f not in claims] == []
    text = folklore.markdown(folklore.table(None))
    for article, titles in TRICKS.items():
        section = text[text.index(f"#### Article {article}"):]
        section = section[:section.index("#### Article", 5)] if "#### Article" in section[5:] else section
        assert all(f"| {article} | {title} |" in section for title in titles)


def test_each_lesson_header_names_a_trick_by_its_articles_own_title():
    """A header's folklore line, "article 000, trick 7 (故障排查与恢复机制, ...)", uses the title the table has
    (what follows a colon is the point of that trick the lesson takes up)."""
    titles = {(t["article"], re.sub(r"^(\d+\. |神操作\d：)", "", t["title"])) for t in DATA["tricks"]}
    numbers = {(t["article"], m.group(1)) for t in DATA["tricks"] if (m := re.match(r"^(?:神操作)?(\d)", t["title"]))}
    cited = 0
    for number, path in LESSONS.items():
        header = "".join(json.loads(path.read_text())["cells"][0]["source"])
        for article, trick, title in re.findall(r"article (\d{3}), trick (\d) \(([^,):：]+)", header):
            cited += 1
            assert (article, title) in titles, f"lesson {number}: {title!r} is not article {article}'s title"
            assert (article, trick) in numbers
    assert cited >= 10


@pytest.mark.skipif(not SEEDS.is_dir(), reason="the source articles are not on this machine")
def test_each_title_is_the_articles_own():
    for article, meta in DATA["articles"].items():
        text = (SEEDS / meta["seed"]).read_text(encoding="utf-8")
        assert meta["title"] in text
        for title in TRICKS[article]:
            assert title in text, f"{title!r} is not in article {article}"


def test_every_row_names_existing_lessons_and_says_how_it_is_decided():
    for trick, row in ROWS:
        assert row["lessons"] and set(row["lessons"]) <= set(LESSONS), row["claim"]
        refs = row.get("for", []) + row.get("against", []) + row.get("see", [])
        assert {ref[:2] for ref in refs} <= set(row["lessons"]), row["claim"]
        assert all(re.match(r"^\d\d: \S", ref) for ref in refs)
        if row.get("for") and row.get("against"):
            assert row.get("when"), f"{row['claim']}: claims on both sides need the condition ('when')"
        if not row.get("for") and not row.get("against"):
            assert row.get("note"), f"{row['claim']}: a row no claim decides says why ('note')"


def _log(tmp_path: Path, outcomes: dict[str, str]) -> Path:
    path = tmp_path / "claims.jsonl"
    path.write_text("".join(json.dumps({"claim": c, "status": s, "measured": f"m{i}", "kind": "check",
                                        "reason": "busy cores" if s == "skipped" else "", "time": 1.0}) + "\n"
                            for i, (c, s) in enumerate(outcomes.items())))
    return path


@pytest.mark.parametrize("for_, against, verdict", [
    ("checked", None, "holds"),
    ("checked", "checked", "holds only when"),
    (None, "checked", "does not hold here"),
    ("skipped", None, "not checked"),
    ("skipped", "skipped", "not checked"),
    ("failed", None, "does not hold here"),        # the claim for it measured false
    (None, "failed", "holds"),                     # the claim against it measured false
    ("checked", "skipped", "holds"),
    ("missing", "missing", "not checked"),
])
def test_the_verdict_is_what_the_logged_outcomes_imply(tmp_path, for_, against, verdict):
    row = {"claim": "c", "lessons": ["03"], "for": ["03: a for"], "against": ["03: an against"], "when": "it rains"}
    logged = {name: status for name, status in (("03: a for claim", for_), ("03: an against claim", against))
              if status not in (None, "missing")}
    if for_ is None:
        row["for"] = []
    if against is None:
        row["against"] = []
    judged = folklore.judge(row, folklore.read_log(_log(tmp_path, logged)))
    assert judged["verdict"] == verdict
    if verdict == "holds only when":
        assert judged["why"] == "it rains"
    if "skipped" in (for_, against) and verdict == "not checked":
        assert "busy cores" in judged["why"]


def test_a_missing_log_leaves_every_row_not_checked(tmp_path):
    rows = folklore.table(tmp_path / "none.jsonl")
    assert {r["verdict"] for r in rows} == {"not checked"}
    assert "not checked" in folklore.folklore_html(tmp_path / "none.jsonl")


def test_the_latest_outcome_of_a_claim_decides(tmp_path):
    path = tmp_path / "claims.jsonl"
    path.write_text(json.dumps({"claim": "03: x", "status": "failed"}) + "\n"
                    + json.dumps({"claim": "03: x", "status": "checked", "measured": "1.5x"}) + "\n")
    judged = folklore.judge({"for": ["03: x"], "lessons": ["03"]}, folklore.read_log(path))
    assert judged["verdict"] == "holds" and judged["evidence"] == [("✓", "03: x", "1.5x")]


SNAPSHOT = [json.loads(line) for line in folklore.SNAPSHOT.read_text(encoding="utf-8").splitlines()]


def test_every_claim_reference_matches_a_claim_a_real_run_logged():
    """The snapshot keeps the lines of a real `make test` claims log that the references matched."""
    logged = [row["claim"] for row in SNAPSHOT[1:]]
    unmatched = [ref for ref in folklore.referenced(DATA) if not any(folklore.matches(ref, c) for c in logged)]
    assert unmatched == []


def test_the_readme_snapshot_is_the_table_its_claims_log_gives():
    """The table's rows equal the claims log of the run that built it: rebuilt from the kept log, word for word."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index(folklore.START):readme.index(folklore.END) + len(folklore.END)]
    assert block == folklore.snapshot_block()
    meta = SNAPSHOT[0]["snapshot"]
    assert meta["machine"] in block and meta["date"] in block and "cores" in meta["machine"] and "torch" in meta["machine"]
    rows = folklore.table(folklore.SNAPSHOT)   # its first line has no claim: read as a log, it is skipped
    for row in rows:
        line = next(l for l in block.splitlines() if l.startswith(f"| {row['article']} | {row['title']} | ")
                    and f"| {row['claim']} |" in l)
        assert f"| {folklore._verdict_text(row)} |" in line


def test_the_cli_writes_the_markdown_and_make_test_calls_it(tmp_path):
    out = tmp_path / "folklore.md"
    assert folklore.main([str(folklore.SNAPSHOT), "--markdown", str(out)]) == 0
    assert out.read_text(encoding="utf-8").count("| 000 |") == sum(t["article"] == "000" for t, _ in ROWS)
    assert folklore.main([str(tmp_path / "missing.jsonl"), "--markdown", str(out)]) == 0
    makefile = (ROOT / "Makefile").read_text()
    target = makefile[makefile.index("\ntest:"):makefile.index("\n\n", makefile.index("\ntest:") + 1)]
    assert "tools/folklore.py $(TEST_RUNS)/claims.jsonl --markdown $(TEST_RUNS)/folklore.md" in target


gspec = importlib.util.spec_from_file_location("glossary", ROOT / "tools" / "glossary.py")
glossary = importlib.util.module_from_spec(gspec)
gspec.loader.exec_module(glossary)


def test_the_glossary_names_existing_lessons_and_every_lesson_has_a_term():
    terms = glossary.terms()
    named = [n for t in terms for n in t["lessons"]]
    assert set(named) <= set(LESSONS), "a term names a lesson that does not exist"
    assert set(LESSONS) <= set(named), f"lessons without a term: {sorted(set(LESSONS) - set(named))}"
    assert all(t["term"] and t["zh"] and t["definition"] and re.search(r"[\u4e00-\u9fff]", t["zh"] + t["term"])
               for t in terms)
    for english, chinese in [("all-reduce", "全规约"), ("bubble", "流水线气泡"), ("straggler", "掉队节点")]:
        assert any(t["term"] == english and chinese in t["zh"] for t in terms)


def test_glossary_md_is_what_its_data_gives():
    assert (ROOT / "notebooks" / "GLOSSARY.md").read_text(encoding="utf-8") == glossary.markdown()
    assert "<table>" in glossary.glossary_html()


def test_each_lesson_header_ends_with_its_chinese_summary():
    for number, path in sorted(LESSONS.items()):
        first = json.loads(path.read_text(encoding="utf-8"))["cells"][0]
        source = "".join(first["source"])
        last = source.rstrip("\n").splitlines()[-1]
        assert first["cell_type"] == "markdown" and last.startswith("**中文**："), f"lesson {number}"
        assert len(re.findall(r"[\u4e00-\u9fff]", last)) >= 15 and len(last) < 220, f"lesson {number}: one or two sentences"


def test_a_star_in_a_reference_stands_for_what_the_machine_sets():
    assert folklore.matches("05: * workers cut t_data", "05: 2 workers cut t_data below 0.75x of none")
    assert folklore.matches("05: * workers cut t_data", "05: 1 workers cut t_data below 0.75x of none")
    assert not folklore.matches("05: * workers cut t_data", "06: 2 workers cut t_data")
    assert folklore.matches("14: ZeRO-3 (x) [y]", "14: ZeRO-3 (x) [y] and more")
