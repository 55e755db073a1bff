"""Pure decisions: lifecycle, validation, commands, process definitions, routes,
authorization, the retention horizon. No I/O."""
