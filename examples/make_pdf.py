"""Rebuild examples/lighthouse.pdf from examples/lighthouse.md (one season per page).

pip install fpdf2 && python examples/make_pdf.py
"""

from pathlib import Path

from fpdf import FPDF

here = Path(__file__).parent
text = (here / "lighthouse.md").read_text()
sections = text.split("\n## ")
pdf = FPDF()
pdf.set_auto_page_break(True, margin=15)
pdf.add_page()
pdf.set_font("Helvetica", "B", 16)
pdf.multi_cell(0, 10, sections[0].lstrip("# ").strip(), new_x="LMARGIN", new_y="NEXT")
for i, section in enumerate(sections[1:]):
    if i:
        pdf.add_page()
    title, _, body = section.partition("\n")
    pdf.set_font("Helvetica", "B", 14)
    pdf.multi_cell(0, 8, title.lstrip("# ").strip(), new_x="LMARGIN", new_y="NEXT")
    pdf.set_font("Helvetica", size=11)
    for para in body.strip().split("\n\n"):
        pdf.multi_cell(0, 6, " ".join(para.split()), new_x="LMARGIN", new_y="NEXT")
        pdf.ln(3)
pdf.output(str(here / "lighthouse.pdf"))
