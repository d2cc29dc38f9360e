"""speckv.cli: the ``speckv`` command (``main``), the demo and the coder bench; the top
layer, which may import every other one."""
