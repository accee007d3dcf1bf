"""TEST DOUBLES: recording stand-ins for libraries this machine lacks (torch_npu, Mooncake
builds with device transports). They check that our code makes the documented calls with the
documented names, in the documented order. A test passing against them is evidence about our
code only, never support for the real library or hardware (docs/accelerators.md keeps the two
apart)."""
