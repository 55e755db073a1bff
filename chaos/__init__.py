"""Evidence under faults: a chaos harness (private services, a real fleet, a seeded
fault schedule) and a read-only checker that counts lost, duplicated and unexpected."""
