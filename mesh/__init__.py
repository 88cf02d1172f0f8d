"""Device pool and worker geometry (aligned CP submeshes), weight replicas, re-carving.

Public API:
  worker_mesh(devices, first_device, cp_degree, axis="cp") -> jax.sharding.Mesh
  DevicePool, DeviceGroup, PendingChange, check_composition
                 a host's workers as aligned power-of-two device groups; split / merge with
                 epochs adopted only when every rank of the new workers is ready
  ParamReplicas, buffer_pointers, shard_bytes
                 one weight replica per device, assembled zero-copy into a worker's
                 replicated parameter tree on any submesh
See mesh/README.md.
"""

from __future__ import annotations

from mesh.device_pool import DeviceGroup, DevicePool, PendingChange, check_composition
from mesh.replicas import ParamReplicas, buffer_pointers, shard_bytes
from mesh.submesh import worker_mesh

__all__ = ["DeviceGroup", "DevicePool", "ParamReplicas", "PendingChange", "buffer_pointers",
           "check_composition", "shard_bytes", "worker_mesh"]
