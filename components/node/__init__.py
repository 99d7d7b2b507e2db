"""What a VM receives (pure: no Pulumi, no cloud): the toolkit's config (config.py), the cloud-config that
writes the boot's files (cloud_init.py), slurm.conf (slurm_conf.py), the toolkit tarball (toolkit.py) and the
node venv's hashed dependency lock (node_lock.py, node-requirements.txt)."""
