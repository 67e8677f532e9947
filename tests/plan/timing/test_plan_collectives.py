"""The alpha-beta collective model against published nccl-tests bus bandwidths of H100 nodes,
and what it changes in the search at scale."""

from __future__ import annotations

import pytest

from scaletrain.models.args import get_preset
from scaletrain.plan.hardware import get_device
from scaletrain.plan.search.space import search
from scaletrain.plan.timing.collectives import (
    LAUNCH_S,
    NETWORK_EFFICIENCY,
    NVLINK_RING_EFFICIENCY,
    Fabric,
)
from scaletrain.plan.timing.step_time import Cluster

H100 = Fabric(get_device("H100"))
BIG = 8 * 2**30  # nccl-tests' largest size (-e 8G), where busbw peaks


@pytest.mark.parametrize(("kind", "n", "per_node", "published"), [
    # 8 GPUs of one node: ring ~370 GB/s, NVLink SHARP all-reduce ~480 GB/s (nccl-tests#212,
    # #290 by NVIDIA engineers; 475 GB/s on 8 H200 in #272).
    ("all_gather", 8, 8, 370.0),
    ("reduce_scatter", 8, 8, 370.0),
    ("all_reduce", 8, 8, 480.0),
    # Across nodes, one NDR 400 Gb/s NIC per GPU: 46-48 GB/s per NIC (nccl-tests#290).
    ("all_reduce", 2, 1, 47.0),
    ("all_gather", 16, 1, 47.0),
    # Two full nodes: NCCL stripes the rings over the 8 NICs of a node, capped by the ring
    # inside the node (~370-400 GB/s across 8xH100 nodes with 8 NDR NICs, nccl-tests#212).
    ("all_reduce", 16, 8, 370.0),
])
def test_bus_bandwidth_matches_published_nccl_tests(kind: str, n: int, per_node: int,
                                                    published: float) -> None:
    assert H100.busbw_gbs(kind, BIG, n, per_node) == pytest.approx(published, rel=0.05)


def test_all_reduce_over_248_nodes_of_8_h200_matches_nccl_tests() -> None:
    # nccl-tests#283: 1,984 H200 (248 nodes, 8 NICs each), 512 MiB all-reduce, default
    # algorithm: "typically around 350G" of bus bandwidth.
    h200 = Fabric(get_device("H200"))
    assert h200.busbw_gbs("all_reduce", 512 * 2**20, 1984, 8) == pytest.approx(350.0, rel=0.05)


def test_cross_node_bus_bandwidth_is_k_nics_per_group_capped_by_the_node() -> None:
    h100 = get_device("H100")
    nic = h100.inter_node_gbs * 1e9 * NETWORK_EFFICIENCY
    node_ring = h100.intra_node_gbs * 1e9 * NVLINK_RING_EFFICIENCY
    # one rank per node (data parallel under TP 8): one NIC
    assert H100.bus_bandwidth("all_gather", 16, 1) == pytest.approx(nic)
    # k ranks per node: k NICs, as long as the node's ring carries them
    for k in (2, 4, 6):
        assert H100.bus_bandwidth("reduce_scatter", 8 * k, k) == pytest.approx(k * nic)
    # 8 per node: 8 NICs (376 GB/s) exceed the NVLink ring (370 GB/s), which caps it
    assert 8 * nic > node_ring
    assert H100.bus_bandwidth("all_gather", 64, 8) == pytest.approx(node_ring)
    # A100 nodes: 8 HDR NICs (188 GB/s) below the NVLink ring
    a100 = Fabric(get_device("A100"))
    assert a100.bus_bandwidth("all_gather", 64, 8) == pytest.approx(8 * 25e9 * NETWORK_EFFICIENCY)
    # DeepSpeed's 2021 ZeRO-3 (stripe_nics=False): one NIC per rank whatever k
    one_nic = Fabric(h100, stripe_nics=False)
    assert one_nic.bus_bandwidth("all_gather", 64, 8) == pytest.approx(nic)
    # inside one node nothing changes
    assert one_nic.bus_bandwidth("all_gather", 8, 8) == H100.bus_bandwidth("all_gather", 8, 8)


def test_ring_latency_pays_the_network_on_the_steps_that_cross_nodes() -> None:
    dev = get_device("H100")
    tiny = 8.0  # bytes: latency only
    intra, inter = dev.intra_latency_us * 1e-6, dev.inter_latency_us * 1e-6
    # 64 ranks on 8 nodes: 7 network steps, 56 NVLink steps (NCCL's tuning model)
    t = H100.time("all_gather", tiny, 64, 8)
    assert t == pytest.approx(LAUNCH_S + 56 * intra + 7 * 1.5 * inter, rel=1e-3)
    # one rank per node on a rail-optimized fabric: every step crosses, one hop each
    t = H100.time("all_gather", tiny, 64, 1)
    assert t == pytest.approx(LAUNCH_S + 63 * inter, rel=1e-3)
    # latency grows with the ranks even when the bandwidth does not
    assert H100.time("all_gather", tiny, 1536, 8) > 20 * H100.time("all_gather", tiny, 64, 8)


def test_latency_dominates_small_messages_and_trees_win_on_many_nodes() -> None:
    small = 64 * 2**10
    assert H100.busbw_gbs("all_reduce", small, 8, 8) < 0.1 * 480
    ring_steps = 2 * (1024 - 1)
    # 1024 nodes, one GPU each: the tree's 2 log2(1024) network steps beat the ring's 2046.
    t = H100.time("all_reduce", small, 1024, 1)
    assert t < ring_steps * get_device("H100").inter_latency_us * 1e-6 / 10
    # ZeRO-3's per-block gathers across many nodes are latency-bound: 8x the ranks, > 4x time.
    block = 2 * 200e6
    assert H100.time("all_gather", block / 8, 4096, 1) > 4 * H100.time("all_gather", block / 8,
                                                                        512, 1)


def test_search_at_16k_gpus_lays_out_like_published_runs() -> None:
    # Llama 3 405B: 16,384 H100s, 8K sequences, 16M-token batches, TP 8 x PP 16 x DP 128.
    args = get_preset("llama3.1-405b")
    fitting, _ = search(args, Cluster(get_device("H100"), 16384), 8192, 16 * 2**20)
    for c in fitting[:3]:
        d = c.layout.dims
        # (ZeRO-3 only under a zero-bubble schedule, where it keeps the blocks gathered as
        # ZeRO-2 does and ties with it)
        assert d.tp == 8 and d.pp > 1 and (c.layout.zero < 3 or c.layout.blocks_stay_gathered)
        assert d.dp * c.layout.mbs <= 2048  # the global batch bounds data parallelism
    # Meta's own layout is among the top 5 (SP keeps 1/tp of every activation and ZeRO-1
    # composes with TP/PP). It was #1 before the planner counted, per stage, torch's receive
    # buffers and the sends its pipeline runtime holds until the step ends (16 GiB at 16
    # micro-batches x 4 chunks: its partial recomputation no longer fits) and before the
    # search proposed the zero-bubble schedules (a third of the bubble; docs/plan.md)
    assert any((c.layout.dims.tp, c.layout.dims.pp, c.layout.dims.dp) == (8, 16, 128)
               for c in fitting[:5])
