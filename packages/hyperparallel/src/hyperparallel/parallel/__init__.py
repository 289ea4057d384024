"""The job's device mesh and the parallelisms laid over it: expert (EP) and pipeline (PP)."""

from hyperparallel.parallel.mesh import FLATTENED_DIMS, MESH_DIMS, MeshSet, ParallelDims, parse_mesh

__all__ = ["FLATTENED_DIMS", "MESH_DIMS", "MeshSet", "ParallelDims", "parse_mesh"]
