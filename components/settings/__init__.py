"""The stack's settings (pure: no Pulumi, no cloud): the schema of every `tiered:` key and its validation
(schema.py), and the Azure facts it checks against, each with its source: SKUs, VM sizes, NID and firewall
rules (azure.py), AMLFS sizing (sizing.py, subnets.py),
Trusted Launch per VM size (vm_security.py), region offers (regions.py), systemd OnCalendar (oncalendar.py)."""
