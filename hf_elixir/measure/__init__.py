"""The measuring room: what hf_elixir times on the machine it runs on, above the runtime
because it runs the real runtime and the real model.

- ``machine.py``: ``calibrate_machine()`` measures a ``HardwareProfile`` (``hf-elixir calibrate``).
- ``calibrate.py``: the kernels, collectives and stand-in model it times.
- ``model_efficiency.py``: times the model being planned, so its compute is priced at what
  it actually runs at; registered with the planner (``planner.efficiency.set_measurer``).
- ``disk.py``: sequential read/write bandwidth of the disk tier's directory (``measure_disk``,
  cached per machine and path by ``disk_figures``).
- ``steal.py``: the share of CPU time a hypervisor took while something was measured.
"""

from hf_elixir.measure.disk import DiskFigures, disk_figures, measure_disk, with_disk
from hf_elixir.measure.machine import calibrate_machine
from hf_elixir.measure.model_efficiency import measure as _measure_model
from hf_elixir.planner.efficiency import set_measurer

set_measurer(_measure_model)

__all__ = ["DiskFigures", "calibrate_machine", "disk_figures", "measure_disk", "with_disk"]
