"""Rank selection, role matching and targeting: one implementation, nothing silent."""

from __future__ import annotations

from profd.actors.selection import match_role_block, role_components, select_ranks
from profd.actors.targeting import resolve_targets
from profd.core.protocol import AgentInfo, ReplicaInfo
from profd.core.request import RoleProfilerConfig, SessionRequest, ToolKind
from profd.core.schedule import group_steps


def block(**kw) -> RoleProfilerConfig:
    return RoleProfilerConfig(**kw)


def test_rank_rule_all_ranks_then_ranks_then_rank0() -> None:
    have = [0, 1, 2, 3]
    assert select_ranks("actor", block(all_ranks=True, ranks=(1,)), have).selected == (0, 1, 2, 3)
    assert select_ranks("actor", block(ranks=(3, 1, 3)), have).selected == (1, 3)
    assert select_ranks("actor", block(), have).selected == (0,)


def test_missing_ranks_are_reported_with_a_reason() -> None:
    sel = select_ranks("actor", block(ranks=(0, 8, 9)), [0, 1], world_size=9)
    assert sel.selected == (0,)
    reasons = {i.rank: i.reason for i in sel.ignored}
    assert "no agent registered for rank 8" in reasons[8]
    assert "out of range (world_size 9)" in reasons[9]


def test_disabled_block_selects_nothing_and_says_so() -> None:
    sel = select_ranks("critic", block(enable=False, all_ranks=True), [0, 1])
    assert sel.selected == () and "enable=false" in sel.ignored[0].reason


def test_role_components() -> None:
    assert role_components("actor_rollout_ref") == ("actor", "rollout", "ref")
    assert role_components("reward_model") == ("reward_model",)
    assert role_components("my_custom_role") == ("my_custom_role",)


def test_block_matching_precedence() -> None:
    blocks = {"ref": block(ranks=(1,)), "actor": block(ranks=(0,)), "*": block(all_ranks=True)}
    assert match_role_block("actor_rollout_ref", blocks)[0] == "actor"
    assert match_role_block("actor_rollout_ref", {**blocks, "actor_rollout_ref": block()})[0] == (
        "actor_rollout_ref"
    )
    assert match_role_block("critic", blocks)[0] == "*"
    assert match_role_block("critic", {"actor": block()}) is None
    assert match_role_block("critic", {})[0] == "*"


def info(role: str, rank: int, world: int | None = 2, **caps) -> AgentInfo:
    return AgentInfo(
        agent_id=f"{role}-{rank}",
        role=role,
        rank=rank,
        world_size=world,
        topology={},
        hostname="h",
        pid=100 + rank,
        capabilities={**{tool.value: None for tool in ToolKind}, **caps},
    )


def test_targeting_reports_everything_it_does_not_use() -> None:
    agents = [info("actor_rollout_ref", 0), info("actor_rollout_ref", 1), info("critic", 0, 1)]
    req = SessionRequest.model_validate(
        {
            "next_steps": 1,
            "roles": {
                "actor": {"ranks": [1, 5]},
                "ref": {"all_ranks": True},
                "reward": {},
            },
        }
    )
    t = resolve_targets(req, agents)
    assert [(x.agent.role, x.agent.rank, x.block_key) for x in t.targets] == [
        ("actor_rollout_ref", 1, "actor")
    ]
    reasons = {(i.role, i.rank): i.reason for i in t.ignored}
    assert "out of range (world_size 2)" in reasons[("actor_rollout_ref", 5)]
    assert "runs inside actor_rollout_ref" in reasons[("ref", None)]
    assert "no live agent has role reward" in reasons[("reward", None)]


def test_targeting_refuses_agents_that_cannot_run_the_tool() -> None:
    agents = [info("actor", 0, torch_memory="CUDA is not available"), info("actor", 1)]
    req = SessionRequest.model_validate(
        {"tool": "torch_memory", "next_steps": 1, "roles": {"actor": {"all_ranks": True}}}
    )
    t = resolve_targets(req, agents)
    assert [x.agent.rank for x in t.targets] == [1]
    assert t.ignored[0].rank == 0 and "CUDA is not available" in t.ignored[0].reason


def test_agent_that_did_not_report_a_tool_is_not_targeted_for_it() -> None:
    agent = AgentInfo("a-0", "actor", 0, 1, {}, "h", 1, capabilities={"torch": None})
    req = SessionRequest.model_validate({"tool": "py_spy", "next_steps": 1})
    t = resolve_targets(req, [agent])
    assert not t.targets and "did not report" in t.ignored[0].reason


def test_no_roles_means_every_role_rank0() -> None:
    agents = [info("actor", 0), info("actor", 1), info("critic", 0, 1)]
    t = resolve_targets(SessionRequest.model_validate({"next_steps": 1}), agents)
    assert sorted((x.agent.role, x.agent.rank) for x in t.targets) == [("actor", 0), ("critic", 0)]


def test_group_steps() -> None:
    assert group_steps([5, 1, 2], continuous=True) == ((1, 2), (5,))
    assert group_steps([5, 1, 2], continuous=False) == ((1,), (2,), (5,))
    assert group_steps([3, 4, 5, 7, 8], continuous=True) == ((3, 4, 5), (7, 8))


def test_topology_filter_selects_matching_agents_and_explains_the_rest() -> None:
    def tinfo(rank: int, tp: int, dp: int) -> AgentInfo:
        base = info("actor", rank, 4)
        return AgentInfo(
            **{**{f: getattr(base, f) for f in base.__slots__}, "topology": {"tp": tp, "dp": dp}}
        )

    agents = [tinfo(0, 0, 0), tinfo(1, 1, 0), tinfo(2, 0, 1), tinfo(3, 1, 1)]
    only_tp0 = SessionRequest.model_validate(
        {"next_steps": 1, "roles": {"actor": {"topology": {"tp": 0}}}}
    )
    t = resolve_targets(only_tp0, agents)
    assert [x.agent.rank for x in t.targets] == [0, 2] and not t.ignored
    with_ranks = SessionRequest.model_validate(
        {"next_steps": 1, "roles": {"actor": {"topology": {"tp": 0}, "ranks": [1, 2]}}}
    )
    t = resolve_targets(with_ranks, agents)
    assert [x.agent.rank for x in t.targets] == [2]
    assert t.ignored[0].rank == 1 and "rank 1 has tp=1, not tp=0" in t.ignored[0].reason
    nobody = SessionRequest.model_validate(
        {"next_steps": 1, "roles": {"actor": {"topology": {"pp": 3}}}}
    )
    t = resolve_targets(nobody, agents)
    assert not t.targets and "no agent has pp=3" in t.ignored[0].reason


def test_topology_on_a_rollout_block_is_reported_not_silently_dropped() -> None:
    replica = AgentInfo(
        "r-0",
        "rollout",
        0,
        1,
        {"tp": 2},
        "h",
        1,
        capabilities={"torch": None},
        replica=ReplicaInfo(world_size=2, global_rank_start=0, global_rank_stop=2),
    )
    req = SessionRequest.model_validate(
        {"duration_s": 1, "roles": {"rollout": {"all_ranks": True, "topology": {"tp": 0}}}}
    )
    t = resolve_targets(req, [replica])
    assert [x.agent.rank for x in t.targets] == [0]
    assert "topology does not apply to rollout replicas" in t.ignored[0].reason
