"""What an SRE looks at: the dashboard's panels, the burn-rate alert rules and a PNG view of the panels."""
