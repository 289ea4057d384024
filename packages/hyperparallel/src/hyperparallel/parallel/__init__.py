"""The job's device mesh and the parallelisms laid over it: expert (EP) and pipeline (PP)."""

from hyperparallel.parallel.mesh import MESH_DIMS, ParallelDims, parse_mesh

__all__ = ["MESH_DIMS", "ParallelDims", "parse_mesh"]
