"""Alpha-beta model of NCCL collectives on a cluster of nodes.

time = alpha x (latency steps of the algorithm) + (bytes each rank moves) / bus bandwidth

- Ring (all-gather, reduce-scatter, all-reduce): n-1 steps for all-gather and reduce-scatter,
  2(n-1) for all-reduce; each rank moves (n-1)/n S, or 2(n-1)/n S for an all-reduce (`S` the
  full tensor). Bus bandwidth is what nccl-tests reports as `busbw`.
- Tree (all-reduce only, across nodes): NCCL's double binary tree, 2 log2(nodes) network steps
  plus the ring inside the node, at about the same bandwidth; NCCL takes the faster of the two
  (trees win for small messages on many nodes).
- NVLink SHARP (NVLS): inside one NVSwitch node an all-reduce runs in the switch, which nccl-tests
  shows as a higher bus bandwidth than the ring's.
- Hierarchy: a group of n ranks with k of them per node. Inside one node it runs over NVLink.
  Across nodes NCCL spreads a ring's channels over the NICs of the group's GPUs in each node
  (one NIC per GPU), so the group's bus bandwidth is k NICs' worth, capped by the ring inside
  the node: NICs next to the GPUs add bandwidth up to the NVLink bandwidth (NCCL's maintainer,
  NVIDIA/nccl#412); nccl-tests measured ~350 GB/s of all-reduce bus bandwidth over 248 nodes of
  8 H200 with 8 NICs each (NVIDIA/nccl-tests#283); PyTorch FSDP's MPT-13B sweep on H100
  (llm-foundry's benchmark table) runs at 393/391/395/394 TFLOP/s on 8/16/32/64 GPUs, flat from
  one node to eight although its ~100 GB of gathers and reduce-scatters per GPU and step would
  need 2-3 NICs per GPU. A group with one rank per node (data parallel under TP 8) gets one NIC.
  `stripe_nics=False` gives every rank one NIC whatever k: DeepSpeed's 2021 ZeRO-3 as measured
  (Narayanan et al. 2021, Table 2; fitted, `plan/search/calibration/`).
- Latency (alpha): a ring's first chunk passes every rank once per pass, so its latency is the
  sum of its hops. As NCCL's own tuning model (`src/graph/tuning.cc`, `ncclTopoTuneModel`),
  the nInterSteps = nodes - 1 steps per pass that cross nodes pay the network's latency, the
  other n - nodes NVLink's. Latency grows with n: a ring over 1,536 ranks on 192 nodes pays
  1,535 hops, ~6 ms per all-gather, whatever its size (each FSDP block pays it per gather). On a
  rail-optimized fabric (`Device.rail_optimized`) a group of one GPU per node stays on one
  leaf switch; other cross-node steps pay 1.5 switch hops on average.

Calibration (H100 SXM nodes, 8 GPUs and 8 ConnectX-7 NDR 400 Gb/s NICs each), from NVIDIA
engineers' answers on the nccl-tests tracker (sources in docs/plan.md): ring bus bandwidth
~370 GB/s over NVLink (450 GB/s line rate, ~20 % protocol overhead; NVIDIA/nccl-tests#212),
NVLS all-reduce ~480 GB/s on 8 GPUs (nccl-tests#212, #290; 475 GB/s on 8 H200: #272), and
46-48 GB/s per 400 Gb/s NIC across nodes (nccl-tests#290).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scaletrain.plan.hardware import Device

NVLINK_RING_EFFICIENCY = 370 / 450
"""Ring bus bandwidth over NVLink / line rate (nccl-tests#212)."""
NVLS_ALLREDUCE_GAIN = 480 / 450
"""NVLink SHARP all-reduce bus bandwidth / line rate on 8 GPUs (nccl-tests#212, #290)."""
NETWORK_EFFICIENCY = 47 / 50
"""Bus bandwidth per NIC / line rate across nodes (46-48 GB/s per NDR NIC, nccl-tests#290)."""
LAUNCH_S = 10e-6
"""Fixed cost of one collective (kernel launch, synchronization)."""
NVLS_DEVICES = ("H100-SXM", "H200", "B200", "GH200", "GH200-144GB")


@dataclass(frozen=True)
class Fabric:
    """The devices and how they are wired: `gpus_per_node` GPUs on NVLink per node."""

    device: Device
    gpus_per_node: int = 8
    stripe_nics: bool = True
    """Across nodes a group with k ranks per node gets k NICs (NCCL's rings striped over
    them); False: one NIC per rank whatever k (DeepSpeed's 2021 ZeRO-3,
    `plan/search/calibration/`)."""

    def _intra(self) -> float:
        return self.device.intra_node_gbs * 1e9 * NVLINK_RING_EFFICIENCY

    def bus_bandwidth(self, kind: str, n: int, per_node: int) -> float:
        """Bytes/s of bus bandwidth of a `kind` collective over `n` ranks, `per_node` of them
        in each node."""
        dev = self.device
        inside = n <= per_node
        if inside and dev.intra_node_gbs > 0:
            if kind == "all_reduce" and dev.name in NVLS_DEVICES and n > 2:
                return dev.intra_node_gbs * 1e9 * NVLS_ALLREDUCE_GAIN
            return self._intra()
        # Across nodes NCCL stripes the ring's channels over the NICs of the group's GPUs in
        # a node: k ranks per node -> k NICs, capped by the ring inside the node
        # (docs/plan.md, "Collectives at scale").
        nics = per_node if self.stripe_nics else 1
        network = nics * dev.inter_node_gbs * 1e9 * NETWORK_EFFICIENCY
        return min(network, self._intra()) if dev.intra_node_gbs > 0 else network

    def _network_step(self, one_per_node: bool) -> float:
        """Seconds of latency of one step across nodes: one switch hop on a rail-optimized
        fabric between same-rank GPUs, 1.5 on average otherwise."""
        dev = self.device
        hops = 1.0 if (dev.rail_optimized and one_per_node) else 1.5
        return dev.inter_latency_us * 1e-6 * hops

    def _ring_latency(self, passes: int, n: int, per_node: int) -> float:
        """Seconds of latency of `passes` ring passes over `n` ranks (n - 1 steps each): the
        steps that cross nodes pay the network's latency, the others NVLink's (NCCL's tuning
        model)."""
        intra = self.device.intra_latency_us * 1e-6
        nodes = math.ceil(n / per_node)
        if nodes <= 1:
            return passes * (n - 1) * intra
        return passes * ((n - nodes) * intra + (nodes - 1) * self._network_step(per_node == 1))

    def time(self, kind: str, size: float, n: int, per_node: int) -> float:
        """Seconds for one collective of `size` bytes (the full tensor) over `n` ranks."""
        if n <= 1 or size <= 0:
            return 0.0
        per_node = max(1, min(per_node, n))
        bw = self.bus_bandwidth(kind, n, per_node)
        moved = (n - 1) / n * size
        if kind in ("all_gather", "reduce_scatter"):
            return LAUNCH_S + self._ring_latency(1, n, per_node) + moved / bw
        if kind != "all_reduce":
            raise ValueError(f"unknown collective '{kind}'")
        ring = LAUNCH_S + self._ring_latency(2, n, per_node) + 2 * moved / bw
        nodes = n / per_node
        if nodes <= 1:
            return ring
        intra_step = self.device.intra_latency_us * 1e-6
        tree = (LAUNCH_S + 2 * math.log2(nodes) * self._network_step(per_node == 1)
                + 2 * (per_node - 1) * intra_step + 2 * moved / bw)
        return min(ring, tree)

    def p2p(self, size: float, across_nodes: bool) -> float:
        """A pipeline send of `size` bytes to the next stage."""
        if size <= 0:
            return 0.0
        dev = self.device
        if across_nodes or dev.intra_node_gbs <= 0:
            return LAUNCH_S + dev.inter_latency_us * 1e-6 + size / (
                dev.inter_node_gbs * 1e9 * NETWORK_EFFICIENCY)
        return LAUNCH_S + dev.intra_latency_us * 1e-6 + size / self._intra()

    def busbw_gbs(self, kind: str, size: float, n: int, per_node: int) -> float:
        """What nccl-tests would print as `busbw` (GB/s) for this collective."""
        t = self.time(kind, size, n, per_node)
        factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
        return size / t * factor / 1e9


def per_node(inner: int, size: int, gpus_per_node: int) -> int:
    """Ranks of a mesh dimension of `size` inside one node, when the dimensions inside it
    multiply to `inner` (the mesh is laid out pp, dp_replicate, dp_shard, cp, tp: tp
    innermost)."""
    if inner >= gpus_per_node:
        return 1
    return max(1, min(size, gpus_per_node // inner))
