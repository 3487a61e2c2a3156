"""Running the app on an offline GPU machine: the bundle (wheels, code, packed data) and the campaign that installs
from it and runs its stages (correctness, throughput, paper-shape) within a time budget."""
