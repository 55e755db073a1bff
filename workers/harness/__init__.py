"""Development and test harnesses (the demo, the fleet of worker processes): above the
production layers, never imported by them."""
