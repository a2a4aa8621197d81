"""Parts of the hostile-tenant soak (bench/hostile_soak.py): tallies, the good client, the attacks, the fake daemon."""
