"""GSA's sparse attention, the Triton code both vendors share: the head-block gather kernels and their
launchers (`headblock`), the dense variant's bitmap build and masked-tile kernels with its forward
passes (`dense`), and the autograd Function, entry points and variant bases the vendor files subclass
(`variant`). Import each name from the module that defines it; this package exports nothing."""
