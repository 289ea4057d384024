"""The planner: what a training run needs per rank at a given mesh, from the job's own code.

:mod:`~hyperparallel.plan.inventory` lists the model's parameters as the job builds, routes and
places them; the other modules turn that into memory, communication and Newton-Schulz work.
"""

from hyperparallel.plan.inventory import Inventory, ParamEntry, mesh_coords, model_inventory

__all__ = ["Inventory", "ParamEntry", "mesh_coords", "model_inventory"]
