"""Sample participants: inventory, payments and shipping, whose effects are rows in
their own tables so that tests and the demo can count them."""
