"""Test doubles for what cannot run here (Azure Resource Manager), shaped like the real services."""
