"""labkit.tricks.plans: transformers' DeepSeek-V3 TP and EP plans, read at run time, beside labkit's own splits."""
import pytest

from labkit.tricks import plans
from labkit.tricks.deepseek import lesson_config


@pytest.fixture(scope="module")
def table():
    return plans.plans_table(lesson_config("ZeRO-3 + TP"))


def test_a_row_for_every_key_of_transformers_plans_with_its_own_style_string(table):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    want = {("tp", k): v for k, v in {**DeepseekV3Config.base_model_tp_plan, **DeepseekV3ForCausalLM._tp_plan}.items()}
    want.update({("ep", k): v for k, v in DeepseekV3Config.base_model_ep_plan.items()})
    got = {(r.plan, r.module): r.transformers for r in table.itertuples()}
    assert {key: got.get(key) for key in want} == want
    assert table.set_index(["plan", "module"]).index.is_unique


def test_the_styles_are_transformers_registered_names(table):
    from transformers.distributed import expert_parallel, tensor_parallel  # noqa: F401
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    named = table[table.transformers != plans.NOT_NAMED]
    assert set(named.transformers) <= set(ALL_PARALLEL_STYLES.keys())
    assert "(effect not recorded)" not in " ".join(table["transformers splits"])


EXPECTED_DIFFERS = {("tp", "layers.*.mlp.experts.gate_up_proj"), ("tp", "layers.*.mlp.experts.down_proj"),
                    ("tp", "layers.*.mlp.experts"), ("tp", "lm_head"), ("tp", "layers.*.self_attn.q_b_proj"),
                    ("tp", "layers.*.self_attn.kv_b_proj"), ("tp", "layers.*.self_attn.o_proj"),
                    ("tp", "layers.*.self_attn.kv_a_proj_with_mqa")}


def test_the_rows_that_differ_are_the_routed_experts_under_tp_attention_and_the_head(table):
    differs = table[table.differs != ""]
    assert set(zip(differs.plan, differs.module)) == EXPECTED_DIFFERS
    assert not differs.differs.str.contains("no reason recorded").any()
    same = table[table.differs == ""]
    assert (same["transformers splits"] == same["labkit splits"]).all()


def test_labkit_splits_the_shared_expert_and_holds_experts_for_ep_as_transformers_does(table):
    rows = table.set_index(["plan", "module"])
    assert rows.loc[("tp", "layers.*.mlp.shared_experts.gate_proj"), "labkit splits"] == plans.OUT
    assert rows.loc[("tp", "layers.*.mlp.shared_experts.down_proj"), "labkit splits"] == plans.IN
    for name in ("gate_up_proj", "down_proj"):
        assert rows.loc[("ep", f"layers.*.mlp.experts.{name}"), "labkit splits"] == plans.EXPERTS


def test_labkit_attention_is_transformers_deepseek_v2_plan(table):
    attention = table[table.module.str.contains("self_attn")]
    assert len(attention) == 4
    for _, row in attention.iterrows():
        assert row.transformers == plans.NOT_NAMED                       # V3's plan leaves attention whole
        assert plans.effect(row.deepseek_v2) == row["labkit splits"]     # what V2's style does
    rope = attention[attention.module.str.endswith("kv_a_proj_with_mqa")].iloc[0]
    assert rope.deepseek_v2 == "mla_kv_a_proj" and rope["labkit splits"] == plans.ROPE


def test_the_tiny_model_has_every_named_module_but_the_dense_mlp(table):
    missing = set(table[~table.in_model].module)
    assert missing == {"layers.*.mlp.gate_proj", "layers.*.mlp.up_proj", "layers.*.mlp.down_proj"}  # no dense layer


def test_packed_colwise_gives_each_rank_a_slice_of_gate_and_of_up():
    """What moe_tp's docstring says of transformers' packed_colwise: its _StridedShard(split_factor=2) on the packed
    dim reads, for rank r of T, the same rows of the gate half and of the up half."""
    from transformers.distributed.sharding_utils import DtensorShardOperation
    rows, ranks = 8, 2   # 2I = 8: gate rows 0..3, up rows 4..7
    got = [DtensorShardOperation._compute_strided_slice(None, [(0, rows)], r, ranks, 2) for r in range(ranks)]
    assert got == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    assert plans.effect("packed_colwise") == f"{plans.OUT}, a slice of each of its 2 packed parts (gate, up)"
