"""The Pulumi ComponentResources: the platform (platform.py) over core storage, network, the AMLFS accelerator
and the GPU cluster; every role definition and assignment in identity.py."""
