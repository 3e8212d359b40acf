"""The document `genpool demo` summarizes (written for this project; public domain)."""

TITLE = "The lighthouse keepers of Skerry Point"

DOCUMENT = """\
For almost two hundred years the lighthouse at Skerry Point was tended by keepers who lived on the
rock with their families. The light was first lit in 1821, fuelled by whale oil and reflected by a
ring of polished copper dishes. Ships passing the reef at night could see it from twenty miles
away, and the number of wrecks on the point fell from several each winter to almost none.

A keeper's day followed the lamp. At dusk the wicks were trimmed and lit; through the night the
keepers took turns to wind the clockwork that turned the lens, and every few hours they climbed the
tower to clean soot from the glass. By day they painted, repaired the boat landing, kept logs of
the weather and signalled to the supply boat, which came every two weeks when the sea allowed.
Storms sometimes kept it away for a month, and the families learned to keep a store of flour,
salted fish and lamp oil that could last a whole winter.

In 1904 the oil lamp was replaced by a paraffin burner with a glass Fresnel lens, which tripled the
light's range. In 1958 the station was connected to a diesel generator, and in 1987 the light was
automated: a sensor now switches it on at dusk, and a technician visits twice a year. The last
keeper, Mary Tulloch, left the rock in the spring of 1988 after thirty-one years of service.

Today the keepers' cottages house a small museum. Visitors can read the logbooks, which record not
only the weather but also births, weddings and the names of every ship that asked for help. The
light still flashes twice every fifteen seconds, and local fishermen say they steer by it exactly as
their grandparents did.
"""
